"""TP=N vs TP=1 parity of every vocab-parallel primitive and every full-vocabulary measure.

Every rank builds the same full logits [T, V_padded] (padding columns hold large garbage that
would dominate if it leaked in), computes the TP=1 result on them with group=None, then the
TP=N result on its own shard [T, V_padded/N]; shard gradients are all-gathered back to the full
vocabulary and compared with the TP=1 gradients. Returns {case: figures} per rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megadiv.divergence.full_vocab  # noqa: F401  (registers the full-vocabulary measures)
from megadiv.divergence import vocab_parallel as vp
from megadiv.divergence.registry import VocabDivergence, get_divergence, names_of_kind

TOKENS = 13        # not a multiple of the chunk: the last chunk is short
CHUNK = 5
FAR = {torch.float64: 400.0, torch.float32: 60.0}   # beyond e^z's range for sums of squares


def _cases(chunk_size):
    """name -> fn(z, z_base, target, shard kwargs) -> list of [T] outputs (each gets its own
    upstream weight in the loss); every primitive and registered VocabDivergence."""
    c = dict(chunk_size=chunk_size)
    cases = {
        "log_probs": lambda z, zb, t, kw: [vp.log_probs(z, t, **kw, **c)],
        "entropy": lambda z, zb, t, kw: [vp.entropy(z, **kw, **c)],
        "log_probs_and_entropy": lambda z, zb, t, kw: list(vp.log_probs_and_entropy(z, t, **kw, **c)),
        "log_probs_and_entropy/inplace": lambda z, zb, t, kw: list(
            vp.log_probs_and_entropy(z, t, inplace_backward=True, **kw, **c)),
    }
    for name in names_of_kind(VocabDivergence):
        torch.manual_seed(1234)     # the same mirror-map parameters on every rank and at TP=1
        measure = get_divergence(name, **c)
        if chunk_size is not None:
            measure.tile_elements = 1024    # 2-4 rows per tile: several tiles per chunk
        cases[f"divergence/{name}"] = (lambda m: lambda z, zb, t, kw: [m(z, zb, **kw)])(measure)
        torch.manual_seed(1234)
        consuming = get_divergence(name, consume_base=True, **c)
        cases[f"consume_base/{name}"] = (
            lambda m: lambda z, zb, t, kw: [m(z, zb.detach(), **kw)])(consuming)
    return cases


def _naive_entropy(z, group, vocab_start, vocab_size):
    """The trap: shard-local partial sums finished by a plain dist.all_reduce, which autograd does
    not see. The normaliser's gradient is right (its local path has the global value), but
    H = -sum_v p_v log p_v loses the cross-shard term: dH/dz_k = -p_k (log p_k + H) needs the
    global H, while differentiating the local partial sum gives the local one."""
    def all_reduce(x, op=dist.ReduceOp.SUM):
        total = x.detach().clone()
        dist.all_reduce(total, op=op, group=group)
        return x + (total - x.detach())                     # value: the total; gradient: local
    zv = z[:, :max(0, min(z.shape[-1], vocab_size - vocab_start))]
    m = all_reduce(zv.detach().amax(-1), dist.ReduceOp.MAX)
    log_p = zv - m[:, None] - torch.log(all_reduce(torch.exp(zv - m[:, None]).sum(-1)))[:, None]
    return [all_reduce(-(log_p.exp() * log_p).sum(-1))]


def _run(fn, z, zb, t, up, kw):
    """Values and gradients (w.r.t. z and zb) of sum_k up_k . out_k."""
    z = z.detach().clone().requires_grad_()
    zb = zb.detach().clone().requires_grad_()
    outs = fn(z, zb, t, kw)
    loss = sum((o * u).sum() for o, u in zip(outs, up))
    loss.backward()
    zb_grad = zb.grad if zb.grad is not None else torch.zeros_like(zb)
    return [o.detach() for o in outs], z.grad, zb_grad


def _gather(shard: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def parity(ctx):
    dist.init_process_group("gloo")
    group, tp, rank = dist.group.WORLD, ctx.world_size, ctx.rank
    ref_cases, cases = _cases(None), _cases(CHUNK)          # TP=1 unchunked, TP=N chunked
    cases["naive_all_reduce_entropy"] = None
    figures = {}
    for dtype in (torch.float64, torch.float32):
        # 1000 divides evenly, 1001 needs TP padding; 700 padded to 1024 leaves the last rank of
        # TP=4 nothing but padding
        for vocab, padded in ((1000, 1000), (1001, -(-1001 // tp) * tp), (700, 1024)):
            width = padded // tp
            g = torch.Generator().manual_seed(vocab)
            z = 3 * torch.randn(TOKENS, width * tp, generator=g, dtype=torch.float64)
            zb = z + torch.randn(TOKENS, width * tp, generator=g, dtype=torch.float64)
            # rows past the CPU passes' unshifted window (vp._unshifted_window), which take their
            # max as the shift: row 3 on rank 0's columns only (the ranks' shifts differ), row 4
            # of the base on every rank
            z[3, :width] += FAR[dtype]
            zb[4] -= FAR[dtype]
            z[:, vocab:], zb[:, vocab:] = 50.0, -50.0       # TP padding: must not count
            target = torch.randint(0, vocab, (TOKENS,), generator=g)
            target[:3] = torch.tensor([0, vocab - 1, width - 1])   # first/last column, shard edge
            up = [torch.randn(TOKENS, generator=g, dtype=torch.float64).to(dtype) for _ in range(2)]
            z, zb = z.to(dtype), zb.to(dtype)
            cols = slice(rank * width, (rank + 1) * width)
            full_kw = dict(vocab_size=vocab)
            shard_kw = dict(group=group, vocab_start=rank * width, vocab_size=vocab)
            for name, fn in cases.items():
                if (fn is None or name.startswith("consume_base/")) and vocab != 1001:
                    continue                                # once is enough for these
                if fn is None:
                    ref = _run(ref_cases["entropy"], z, zb, target, up, full_kw)
                    out = _run(lambda z_, zb_, t, kw: _naive_entropy(z_, **kw),
                               z[:, cols], zb[:, cols], target, up, shard_kw)
                else:
                    ref = _run(ref_cases[name], z, zb, target, up, full_kw)
                    out = _run(fn, z[:, cols], zb[:, cols], target, up, shard_kw)
                (ref_vals, ref_grad, ref_grad_b), (vals, grad, grad_b) = ref, out
                # rows whose target lies on another rank: their gradient here must still be -p
                not_owned = (target < rank * width) | (target >= (rank + 1) * width)
                not_owned[3] = False        # its p is ~e^-FAR off rank 0's columns
                valid = max(0, min(width, vocab - rank * width))
                figures[(str(dtype).split(".")[-1], vocab, name)] = {
                    "value": max(float((v - r).abs().max()) for v, r in zip(vals, ref_vals)),
                    "grad": float((_gather(grad, group) - ref_grad).abs().max()),
                    "grad_base": float((_gather(grad_b, group) - ref_grad_b).abs().max()),
                    "grad_scale": float(ref_grad.abs().max()),
                    "grad_base_scale": float(ref_grad_b.abs().max()),
                    "not_owned_grad": (float(grad[not_owned, :valid].abs().amax(-1).min())
                                       if valid else None),
                    "padding_grad": float(_gather(grad, group)[:, vocab:].abs().sum()),
                }
    return {"tp": tp, "figures": figures}
