"""Log-probs, entropy and full-distribution divergences from vocab-parallel logits.

Tensor parallelism splits the output layer along the vocabulary: rank r of a TP group of size
TP holds logits ``z`` of shape [tokens, V/TP] for global vocabulary columns
[vocab_start, vocab_start + V/TP). Columns at or past the true vocabulary size are padding
(the padded vocabulary is a multiple of TP) and carry no probability. Nothing here gathers the
vocabulary: every quantity is a per-token sum over the vocabulary, so each rank sums its own
columns and one all-reduce of a [tokens] vector finishes the job.

Why these are autograd Functions (docs/vocab_parallel.md): log p_t = z_t - logsumexp(z) depends
on every column of every rank through the normaliser. A shard-local computation whose normaliser
comes from a plain ``dist.all_reduce`` (which autograd does not see) drops the -p_v term of
d log p_t / d z_v on every rank, and gives a zero gradient on ranks that do not own the target
token. Here the forward does the reductions and the backward writes the exact gradient of each
shard from the saved per-token statistics, e.g. d log p_t / d z_v = [v = t] - p_v on every rank.

Memory: the forward keeps no [tokens, V/TP] tensor; the backward recomputes p chunk by chunk.
Tokens are processed in chunks of ``chunk_size`` rows, small by default so that a chunk's few
temporaries stay in the CPU cache / do not grow with the sequence. Extra peak memory is the
gradient (or nothing, with ``inplace_backward``) plus O(chunk x V/TP).

``group=None`` (or a group of size 1) means the vocabulary is not sharded: no communication.
Half-precision logits are upcast chunk by chunk; statistics and reductions are float32 (float64
for float64 logits), and each logsumexp subtracts the maximum first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

# Default chunk: about 2^19 logits (2 MiB in float32) per chunk, a few temporaries of which fit in
# a CPU core's L2/L3 cache; on GPUs a larger chunk (e.g. 1024 tokens) amortises kernel launches.
CHUNK_ELEMENTS = 1 << 19

# pointwise(a, b, p, q, value, base_grad) -> (f, F, G) for a separable divergence
# D = sum_v f(a_v, b_v), a = log p, b = log q (chunks [rows, V_valid]); F = df/da and G = df/db;
# f is None unless ``value`` (the backward needs only F, G), G None unless ``base_grad``.
Pointwise = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool, bool],
                     tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logit columns sit in the vocabulary, and how to walk its tokens."""

    group: object | None   # the TP process group; None = unsharded
    vocab_start: int       # global index of this shard's first column
    valid: int             # how many leading columns are real vocabulary (the rest is padding)
    chunk_size: int        # token rows per chunk

    @staticmethod
    def of(logits: torch.Tensor, group=None, vocab_start: int = 0, vocab_size: int | None = None,
           chunk_size: int | None = None) -> "VocabShard":
        width = logits.shape[-1]
        valid = width if vocab_size is None else max(0, min(width, vocab_size - vocab_start))
        if chunk_size is None:
            chunk_size = max(1, CHUNK_ELEMENTS // max(valid, 1))
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if group is not None and dist.get_world_size(group) == 1:
            group = None
        return VocabShard(group, vocab_start, valid, chunk_size)

    def chunks(self, rows: int):
        for i in range(0, rows, self.chunk_size):
            yield slice(i, min(i + self.chunk_size, rows))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _local_exp_sums(z: torch.Tensor, shard: VocabShard, dtype: torch.dtype, with_dot: bool):
    """Per token of the local valid columns: m = max z, s = sum e^(z - m), and, with ``with_dot``,
    d = sum e^(z - m) (z - m). z: [N, V/TP] -> three [N] tensors (d None without with_dot).
    A shard with no valid column reports m = the most negative float, s = d = 0."""
    rows = z.shape[0]
    m = torch.full((rows,), torch.finfo(dtype).min, dtype=dtype)
    s = torch.zeros(rows, dtype=dtype)
    d = torch.zeros(rows, dtype=dtype) if with_dot else None
    if shard.valid == 0:
        return m, s, d
    for rs in shard.chunks(rows):
        c = z[rs, :shard.valid].to(dtype)                   # [B, V_valid]
        mc = c.amax(dim=-1, keepdim=True)                   # [B, 1]
        x = c - mc                                          # <= 0
        e = torch.exp(x)
        m[rs] = mc.squeeze(-1)
        s[rs] = e.sum(dim=-1)
        if with_dot:
            d[rs] = torch.linalg.vecdot(e, x)
    return m, s, d


def _global_max(m: torch.Tensor, group) -> torch.Tensor:
    return _all_reduce(m.clone(), dist.ReduceOp.MAX, group)


def _target_logit(z: torch.Tensor, target: torch.Tensor, shard: VocabShard, dtype):
    """z[n, target[n]] on the rank whose valid columns hold target[n], 0 elsewhere; [N]."""
    local = target - shard.vocab_start
    owned = (local >= 0) & (local < shard.valid)
    local = torch.where(owned, local, torch.zeros_like(local))
    picked = z.gather(1, local.unsqueeze(1)).squeeze(1).to(dtype)
    return torch.where(owned, picked, torch.zeros_like(picked)), owned, local


class _LogProbEntropy(torch.autograd.Function):
    """(log p_t, H) per token from a vocab shard; either output may be left out.

    With M the global max, S = sum_v e^(z_v - M) and E = E_p[z - M]:
        log Z = M + log S,  log p_t = z_t - log Z,  H = -sum_v p_v log p_v = log S - E.
    Gradients (every shard, every valid column v; padding gets 0):
        d log p_t / d z_v = [v = t] - p_v,    d H / d z_v = -p_v (log p_v + H).
    """

    @staticmethod
    def forward(ctx, logits, target, shard: VocabShard, want_entropy: bool, inplace: bool):
        ctx.set_materialize_grads(False)
        z = logits.reshape(-1, logits.shape[-1])            # [N, V/TP]
        dtype = _compute_dtype(z.dtype)
        m, s, d = _local_exp_sums(z, shard, dtype, with_dot=want_entropy)
        big_m = _global_max(m, shard.group)
        scale = torch.exp(m - big_m)                        # rescale local sums to the global max
        # One SUM all-reduce of [k, N]: S, then E*S = sum e^(z-M)(z-M), then the target logit.
        parts = [s * scale]
        if want_entropy:
            parts.append((d + (m - big_m) * s) * scale)
        if target is not None:
            target = target.reshape(-1)
            z_t, owned, local = _target_logit(z, target, shard, dtype)
            parts.append(z_t)
        sums = _all_reduce(torch.stack(parts), dist.ReduceOp.SUM, shard.group)
        log_s = torch.log(sums[0])
        log_z = big_m + log_s                               # [N]
        lead = logits.shape[:-1]
        outputs, entropy = [], None
        if target is not None:
            outputs.append((sums[-1] - log_z).reshape(lead))
        if want_entropy:
            entropy = log_s - sums[1] / sums[0]
            outputs.append(entropy.reshape(lead))
        ctx.shard, ctx.inplace = shard, inplace
        ctx.want = (target is not None, want_entropy)
        ctx.save_for_backward(logits, log_z, entropy,
                              *((owned, local) if target is not None else ()))
        return tuple(outputs) if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads):
        logits, log_z, entropy, *picked = ctx.saved_tensors
        shard = ctx.shard
        want_logp, want_entropy = ctx.want
        g_logp = grads[0] if want_logp else None
        g_ent = grads[-1] if want_entropy else None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        z = logits.reshape(-1, logits.shape[-1])
        dtype = log_z.dtype
        # [N, 1] coefficients: d loss / d z_v = -p_v (g_logp + g_ent (log p_v + H)) + g_logp [v = t]
        g_l = (g_logp.reshape(-1, 1).to(dtype) if g_logp is not None
               else torch.zeros_like(log_z).unsqueeze(1))
        g_h = g_ent.reshape(-1, 1).to(dtype) if g_ent is not None else None
        h = entropy.unsqueeze(1) if g_h is not None else None
        with torch.no_grad():
            # In place: the gradient overwrites the logits chunk by chunk (each chunk is read
            # before it is written); autograd's version counter then stops any other user of
            # these logits from backpropagating through stale values.
            grad = z if ctx.inplace else torch.empty_like(z)
            for rs in shard.chunks(z.shape[0]):
                x = z[rs, :shard.valid].to(dtype) - log_z[rs].unsqueeze(1)   # log p, [B, V_valid]
                p = torch.exp(x)
                if g_h is None:
                    x = p.mul_(-g_l[rs])
                else:
                    x.add_(h[rs]).mul_(-g_h[rs]).sub_(g_l[rs]).mul_(p)
                grad[rs, :shard.valid] = x
            grad[:, shard.valid:] = 0
            if g_logp is not None:
                owned, local = picked
                rows = owned.nonzero().squeeze(1)
                grad.index_put_((rows, local[rows]), g_l.squeeze(1)[rows].to(grad.dtype),
                                accumulate=True)
        return grad.view(logits.shape), None, None, None, None


def log_probs_and_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                          vocab_start: int = 0, vocab_size: int | None = None,
                          chunk_size: int | None = None, inplace_backward: bool = False):
    """(log p(target), entropy), each [...], from logits [..., V/TP] with one pass of reductions.

    ``target``: [...] global token ids. ``inplace_backward=True`` writes the gradient into the
    logits' storage (as megatron-core's cross entropy does), saving one [tokens, V/TP] buffer;
    use it only when nothing else will backpropagate through these logits (autograd raises if
    something does).
    """
    shard = VocabShard.of(logits, group, vocab_start, vocab_size, chunk_size)
    return _LogProbEntropy.apply(logits, target, shard, True, inplace_backward)


def log_probs(logits: torch.Tensor, target: torch.Tensor, group=None, vocab_start: int = 0,
              vocab_size: int | None = None, chunk_size: int | None = None,
              inplace_backward: bool = False) -> torch.Tensor:
    """log p(target) [...] from logits [..., V/TP]; see :func:`log_probs_and_entropy`."""
    shard = VocabShard.of(logits, group, vocab_start, vocab_size, chunk_size)
    return _LogProbEntropy.apply(logits, target, shard, False, inplace_backward)


def entropy(logits: torch.Tensor, group=None, vocab_start: int = 0,
            vocab_size: int | None = None, chunk_size: int | None = None,
            inplace_backward: bool = False) -> torch.Tensor:
    """-sum_v p_v log p_v [...] from logits [..., V/TP]; see :func:`log_probs_and_entropy`."""
    shard = VocabShard.of(logits, group, vocab_start, vocab_size, chunk_size)
    return _LogProbEntropy.apply(logits, None, shard, True, inplace_backward)


def _log_normalisers(z: torch.Tensor, z_base: torch.Tensor, shard: VocabShard, dtype):
    """Global logsumexp over the vocabulary of both logit shards: two [N] tensors."""
    m, s, _ = _local_exp_sums(z, shard, dtype, with_dot=False)
    m_b, s_b, _ = _local_exp_sums(z_base, shard, dtype, with_dot=False)
    m = torch.stack([m, m_b])                               # [2, N]
    big_m = _global_max(m, shard.group)
    sums = _all_reduce(torch.stack([s, s_b]) * torch.exp(m - big_m), dist.ReduceOp.SUM, shard.group)
    log_z = big_m + torch.log(sums)
    return log_z[0], log_z[1]


class _SeparableDivergence(torch.autograd.Function):
    """D = sum_v f(log p_v, log q_v) per token, p = softmax(logits), q = softmax(logits_base).

    With F = df/da and G = df/db at each column (a = log p, b = log q), d a_v / d z_k = [v = k] - p_k
    gives the gradients
        dD/dz_k = F_k - p_k sum_v F_v,     dD/dz^base_k = G_k - q_k sum_v G_v,
    whose per-token sums are all-reduced in the forward pass (they do not depend on the upstream
    gradient), so the backward needs no communication.
    """

    @staticmethod
    def forward(ctx, logits, logits_base, pointwise: Pointwise, shard: VocabShard):
        if logits.shape != logits_base.shape:
            raise ValueError(f"logits {tuple(logits.shape)} and logits_base "
                             f"{tuple(logits_base.shape)} differ in shape")
        z = logits.reshape(-1, logits.shape[-1])
        z_b = logits_base.reshape(-1, logits_base.shape[-1])
        dtype = _compute_dtype(z.dtype)
        base_grad = ctx.needs_input_grad[1]
        log_z, log_z_b = _log_normalisers(z, z_b, shard, dtype)
        sums = torch.zeros(3, z.shape[0], dtype=dtype)      # sum_v f, sum_v F, sum_v G
        if shard.valid > 0:
            for rs in shard.chunks(z.shape[0]):
                a = z[rs, :shard.valid].to(dtype) - log_z[rs].unsqueeze(1)
                b = z_b[rs, :shard.valid].to(dtype) - log_z_b[rs].unsqueeze(1)
                f, f_a, f_b = pointwise(a, b, torch.exp(a), torch.exp(b), True, base_grad)
                sums[0, rs] = f.sum(dim=-1)
                sums[1, rs] = f_a.sum(dim=-1)
                if base_grad:
                    sums[2, rs] = f_b.sum(dim=-1)
        sums = _all_reduce(sums, dist.ReduceOp.SUM, shard.group)
        ctx.pointwise, ctx.shard = pointwise, shard
        ctx.save_for_backward(logits, logits_base, log_z, log_z_b, sums[1], sums[2])
        return sums[0].reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, g):
        logits, logits_base, log_z, log_z_b, sum_f_a, sum_f_b = ctx.saved_tensors
        shard, pointwise = ctx.shard, ctx.pointwise
        want, want_base = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        z = logits.reshape(-1, logits.shape[-1])
        z_b = logits_base.reshape(-1, logits_base.shape[-1])
        dtype = log_z.dtype
        g = g.reshape(-1, 1).to(dtype)
        with torch.no_grad():
            grad = torch.zeros_like(z) if want else None      # padding columns stay 0
            grad_b = torch.zeros_like(z_b) if want_base else None
            if shard.valid > 0:
                for rs in shard.chunks(z.shape[0]):
                    a = z[rs, :shard.valid].to(dtype) - log_z[rs].unsqueeze(1)
                    b = z_b[rs, :shard.valid].to(dtype) - log_z_b[rs].unsqueeze(1)
                    p, q = torch.exp(a), torch.exp(b)
                    _, f_a, f_b = pointwise(a, b, p, q, False, want_base)
                    if want:   # g (F - p sum F)
                        grad[rs, :shard.valid] = p.mul_(-sum_f_a[rs].unsqueeze(1)).add_(f_a).mul_(g[rs])
                    if want_base:
                        grad_b[rs, :shard.valid] = q.mul_(-sum_f_b[rs].unsqueeze(1)).add_(f_b).mul_(g[rs])
        return (grad.view(logits.shape) if want else None,
                grad_b.view(logits_base.shape) if want_base else None, None, None)


def separable_divergence(pointwise: Pointwise, logits: torch.Tensor, logits_base: torch.Tensor,
                         group=None, vocab_start: int = 0, vocab_size: int | None = None,
                         chunk_size: int | None = None) -> torch.Tensor:
    """sum_v f(log p_v, log q_v) per token ([...]) from logit shards [..., V/TP] of the current
    (p) and base (q) policies; gradients flow to both (the base's only if it requires grad)."""
    shard = VocabShard.of(logits, group, vocab_start, vocab_size, chunk_size)
    return _SeparableDivergence.apply(logits, logits_base, pointwise, shard)
