"""Log-probs, entropy and full-distribution divergences from vocab-parallel logits.

Tensor parallelism splits the output layer along the vocabulary: rank r of a TP group of size
TP holds logits ``z`` of shape [tokens, V/TP] for global vocabulary columns
[vocab_start, vocab_start + V/TP). Columns at or past the true vocabulary size are padding
(the padded vocabulary is a multiple of TP) and carry no probability. Nothing here gathers the
vocabulary: every quantity is a per-token sum over the vocabulary, so each rank sums its own
columns and one all-reduce of a [tokens] vector finishes the job.

Why these are autograd Functions (docs/vocab_parallel.md): log p_t = z_t - logsumexp(z), H and
every divergence depend on every column of every rank through the normaliser. A shard-local
computation finished by a plain ``dist.all_reduce`` lets autograd differentiate only the local
part: with a detached normaliser, d log p_t / d z_v loses its -p_v term and ranks that do not own
the target token get no gradient at all; for the entropy and the divergences, whose gradients
contain a sum over the whole vocabulary (dH/dz_k = -p_k (log p_k + H)), the gradient is wrong on
every rank even when the normaliser carries the right value. Here the forward does the
reductions and the backward writes the exact gradient of each shard from per-token statistics
that are already global, e.g. d log p_t / d z_v = [v = t] - p_v on every rank.

Memory: tokens are processed in chunks of ``chunk_size`` rows (default: a per-device byte budget,
:func:`default_chunk_rows`); extra memory is O(chunk x V/TP) plus the gradient. Every buffer is
allocated on the logits' device, and nothing synchronises with the host. Log-prob/entropy keep no [tokens, V/TP] tensor for the backward, which
recomputes p chunk by chunk (with ``inplace_backward`` the gradient overwrites the logits).
Divergences compute their gradient in the forward, into the buffer the backward returns (with
``consume_base``, the reference logits' storage); ProbL2 does so by a closed form of its own
(:func:`prob_l2_divergence`).

Allocation: each pass takes its chunk-sized temporaries from one :class:`Workspace`, allocated
once per call and reused by every chunk (``out=`` ops and in-place updates; where the gradient's
dtype is the compute dtype, the gradient's own rows are the working buffer). A fresh temporary per
chunk would cost, on CPU, a page fault per 4 KiB whenever the C allocator returns freed blocks to
the OS (glibc with a fixed ``MALLOC_MMAP_THRESHOLD_``): docs/performance.md measured 3-6x slower.

``group=None`` (or a group of size 1) means the vocabulary is not sharded: no communication.
Half-precision logits are upcast chunk by chunk; statistics and reductions are float32 (float64
for float64 logits), and each logsumexp subtracts the maximum first (on CPU a divergence's
exps skip that pass where e^z itself is safe: :func:`_shard_exps`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist

# Chunk sizes by device, in bytes of one float32 [rows, V/TP] temporary (the rows follow from the
# shard width, never fewer than the floor). CPU: log-prob/entropy chunks and divergence tiles of
# 1 MiB keep a chunk's few temporaries in L2/L3 between the elementwise ops, and are reused from
# one Workspace per call (see the module doc); a chunk runs ~10 small ops, and 1 MiB rather than
# 512 KiB halves their Python cost (7-12% faster in all at 32k columns, measured). GPU: the
# loop over chunks is a Python loop of kernel launches, so a chunk must cover many rows (128 MiB
# is ~220 rows at a 150k vocabulary, TP=1) while its temporaries stay small next to the
# [tokens, V/TP] logits; the floor keeps a launch per few rows from ever happening.
CHUNK_ELEMENTS = 1 << 18
CHUNK_BYTES = {"cpu": CHUNK_ELEMENTS * 4, "gpu": 128 << 20}
# Divergence chunks: each costs collectives (two; one for ProbL2) and holds the exps of both logits
# over its rows (2 buffers of this size; 2 more for the per-logit derivatives of half-precision
# logits in the generic pass, which are otherwise written into the gradient): written before the
# chunk's collective and read after it, so on CPU they should stay in cache. 8 MiB each (65 rows of
# a 32k shard): at 16 MiB KL and ProbL2 took 10-15% more CPU time (TP=1, measured), and smaller
# chunks mean more collectives, ~0.3-0.9 ms of CPU each under gloo on a loaded machine. GPU: 256 MiB.
DIVERGENCE_CHUNK_BYTES = {"cpu": 8 << 20, "gpu": 256 << 20}
MIN_CHUNK_ROWS = {"cpu": 1, "gpu": 64}


def default_chunk_rows(width: int, device: torch.device, budget: dict[str, int] = CHUNK_BYTES) -> int:
    """Rows per chunk for shards ``width`` columns wide on ``device``: the device's byte budget
    of float32 temporaries, at least its floor in rows."""
    kind = "cpu" if torch.device(device).type == "cpu" else "gpu"
    return max(MIN_CHUNK_ROWS[kind], budget[kind] // (4 * max(width, 1)))


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logit columns sit in the vocabulary, and how to walk its tokens."""

    group: object | None   # the TP process group; None = unsharded
    vocab_start: int       # global index of this shard's first column
    valid: int             # how many leading columns are real vocabulary (the rest is padding)
    chunk_size: int        # token rows per chunk

    @staticmethod
    def of(logits: torch.Tensor, group=None, vocab_start: int = 0, vocab_size: int | None = None,
           chunk_size: int | None = None, budget: dict[str, int] = CHUNK_BYTES) -> "VocabShard":
        width = logits.shape[-1]
        valid = width if vocab_size is None else max(0, min(width, vocab_size - vocab_start))
        if chunk_size is None:
            chunk_size = default_chunk_rows(valid, logits.device, budget)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if group is not None and dist.get_world_size(group) == 1:
            group = None
        return VocabShard(group, vocab_start, valid, chunk_size)

    def chunks(self, rows: int):
        for i in range(0, rows, self.chunk_size):
            yield slice(i, min(i + self.chunk_size, rows))


class Workspace:
    """Scratch buffers [rows, width] of one call, each allocated on its first use and then reused
    by every chunk: ``take(name, n)`` is the first n rows of buffer ``name``. Callers write into
    them with ``out=`` ops, so a pass over any number of chunks allocates each buffer once."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = (rows, width), dtype, device
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return buf[:rows]

    def upcast(self, x: torch.Tensor, name: str = "upcast") -> torch.Tensor:
        """``x`` [n, width] itself in the workspace's dtype, else a copy into buffer ``name``."""
        return x if x.dtype == self.dtype else self.take(name, x.shape[0]).copy_(x)


def rows_per(elements: int, width: int) -> int:
    """Rows of ``width`` columns in about ``elements`` entries (at least one)."""
    return max(1, elements // max(width, 1))


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
    rows, device = z.shape[0], z.device
    m = torch.full((rows,), torch.finfo(dtype).min, dtype=dtype, device=device)
    s = torch.zeros(rows, dtype=dtype, device=device)
    d = torch.zeros(rows, dtype=dtype, device=device) if with_dot else None
    if shard.valid == 0:
        return m, s, d
    ws = Workspace(min(shard.chunk_size, rows), shard.valid, dtype, device)
    for rs in shard.chunks(rows):
        n = rs.stop - rs.start
        c = ws.upcast(z[rs, :shard.valid])                  # [B, V_valid]
        torch.amax(c, dim=-1, out=m[rs])
        x = torch.sub(c, m[rs].unsqueeze(1), out=ws.take("shifted", n))   # <= 0
        if with_dot:   # (linalg.vecdot would allocate its product: [B, V_valid] per chunk)
            e = torch.exp(x, out=ws.take("exp", n))
            torch.sum(e, dim=-1, out=s[rs])
            torch.sum(e.mul_(x), dim=-1, out=d[rs])
        else:
            torch.sum(x.exp_(), dim=-1, out=s[rs])
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
        #                                     = p_v (log p_v (-g_ent) - (g_logp + g_ent H)) + ...
        g_l = (g_logp.reshape(-1, 1).to(dtype) if g_logp is not None
               else torch.zeros_like(log_z).unsqueeze(1))
        g_h = g_ent.reshape(-1, 1).to(dtype) if g_ent is not None else None
        if g_h is not None:
            slope, offset = -g_h, -(g_l + g_h * entropy.unsqueeze(1))
        with torch.no_grad():
            # In place: the gradient overwrites the logits chunk by chunk (each chunk is read
            # before it is written); autograd's version counter then stops any other user of
            # these logits from backpropagating through stale values.
            grad = z if ctx.inplace else torch.empty_like(z)
            # a gradient in the compute dtype is its own working buffer; a half-precision one is
            # computed in a float32 chunk and rounded into place
            direct = grad.dtype == dtype
            ws = Workspace(min(shard.chunk_size, z.shape[0]), shard.valid, dtype, z.device)
            if g_logp is not None:
                # + g_logp at the target column of the rows this shard owns: a scatter of zeros
                # into column 0 of the other rows (no owned.nonzero(), a device-to-host sync)
                owned, local = picked
                add = torch.where(owned, g_l.squeeze(1), 0).unsqueeze(1)
            for rs in shard.chunks(z.shape[0]):
                n = rs.stop - rs.start
                out = grad[rs, :shard.valid] if direct else ws.take("grad", n)
                x = torch.sub(z[rs, :shard.valid], log_z[rs].unsqueeze(1), out=out)  # log p, [B, V_valid]
                if g_h is None:
                    x.exp_().mul_(-g_l[rs])
                else:
                    p = torch.exp(x, out=ws.take("probs", n))
                    x.mul_(slope[rs]).add_(offset[rs]).mul_(p)   # (addcmul is 4x slower on CPU)
                if g_logp is not None and shard.valid:   # in the compute dtype: a half-precision
                    x.scatter_add_(1, local[rs].unsqueeze(1), add[rs])   # gradient is rounded once
                if not direct:
                    grad[rs, :shard.valid] = x
            grad[:, shard.valid:] = 0
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


def _gather_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """x of every rank of ``group``, stacked: [TP, *x.shape] (one all_gather; [1, ...] unsharded)."""
    if group is None:
        return x.unsqueeze(0)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


def _divergence_tiles(rs: slice, tile: int):
    """(chunk rows, global rows) of each tile of chunk ``rs``."""
    return [(slice(i - rs.start, min(i + tile, rs.stop) - rs.start), slice(i, min(i + tile, rs.stop)))
            for i in range(rs.start, rs.stop, tile)]


def _unshifted_window(dtype: torch.dtype, width: int) -> tuple[float, float]:
    """Bounds on a row's s = sum_v e^(z_v) over ``width`` columns within which the unshifted
    exps are safe for sums of their squares (ProbL2's dot products): s <= hi keeps every e^2
    and their sum over the row finite, s >= lo keeps the row's largest e^2 a normal float."""
    info, log_w = torch.finfo(dtype), math.log(max(width, 1))
    return (math.exp(math.log(info.tiny) / 2 + log_w + 1),
            math.exp((math.log(info.max) - log_w) / 2 - 1))


def _exps_below_max(c: torch.Tensor, out: torch.Tensor, m: torch.Tensor) -> None:
    """out = e^(c - m) with m the row's max: c, out [n, W]; m [n] (written)."""
    torch.amax(c, dim=-1, out=m)
    torch.sub(c, m.unsqueeze(1), out=out).exp_()


def _elementwise_products(device: torch.device) -> bool:
    """Whether ProbL2's row dot products and its K = 2 products run elementwise rather than as
    batched matmuls: on CUDA, where cuBLAS may compute float32 matmuls in TF32 (10 mantissa bits)
    whatever torch's flags say (the NGC image's TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 overrides
    them), which errs by ~1e-3 p_j in the gradient's r term. CPU matmuls are exact float32 and
    read each entry once, so the CPU keeps them."""
    return device.type == "cuda"


def _row_dots(e: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
    """out[i, k, l] = sum_v e[i, k, v] e[i, l, v]: e [n, 2, W], out [n, 2, 2]; ``scratch``
    [n, W] holds a product on the elementwise path (_elementwise_products)."""
    if not _elementwise_products(e.device):
        torch.bmm(e, e.transpose(1, 2), out=out)
        return
    for k, l in ((0, 0), (0, 1), (1, 1)):
        out[:, k, l] = torch.mul(e[:, k], e[:, l], out=scratch).sum(dim=-1)
    out[:, 1, 0] = out[:, 0, 1]


def _shard_exps(z, z_b, exps: torch.Tensor, tile: int, tile_ws: Workspace,
                dots: torch.Tensor | None = None):
    """First phase of a divergence chunk: ``exps[:, k] = e^(z_k - m_k)`` from the chunk's rows
    z_0 = z, z_1 = z_b [n, V_valid], ``tile`` rows at a time; returns the shifts m and the sums
    s_k = sum e^(z_k - m_k) over the shard, [2, n] each. With ``dots`` [n, 2, 2], also the row
    dot products of the two exps (one batched matmul per tile, which reads each entry once and
    writes nothing else). A shard with no valid column has m = the most negative float, s = 0.

    The shift m is the row's max (as in any logsumexp), except on CPU, where it is 0 for every
    row whose s lands in :func:`_unshifted_window` (e = e^z directly), and only the other rows
    are redone with their max. On CPU these ops are bound by memory bandwidth and the max and
    the subtraction are two more passes over the logits; e^z loses nothing against e^(z - m) in
    the window (each rounds once, relative to its size). Within an LLM's logits (|z| < ~35 at
    float32) no row is redone. The check costs a host sync, which a CPU has anyway; a GPU pass
    takes the max (nothing there synchronises with the host). One exp per logit; exp and sum
    as separate cache-resident passes (the fused softmax kernel, which also normalises, plus two
    max passes to recover its log-sum-exp, made a whole ProbL2 call 15% slower on CPU, measured).
    """
    dtype, n, width = exps.dtype, exps.shape[0], exps.shape[-1]
    unshifted = exps.device.type == "cpu"
    m = torch.full((2, n), 0.0 if unshifted and width else torch.finfo(dtype).min, dtype=dtype,
                   device=exps.device)
    sums = torch.zeros(n, 2, dtype=dtype, device=exps.device)
    if width == 0:
        return m, sums.T
    # views of every tile at once (split), not a Python slice per tensor and tile
    parts = zip(z.split(tile), z_b.split(tile), exps.split(tile), m.split(tile, dim=1), sums.split(tile),
                dots.split(tile) if dots is not None else [None] * n)
    for z_t, z_b_t, e, m_t, s_t, dots_t in parts:
        for k, src in enumerate((z_t, z_b_t)):
            c = tile_ws.upcast(src)
            if unshifted:
                torch.exp(c, out=e[:, k])
            else:
                _exps_below_max(c, e[:, k], m_t[k])
        torch.sum(e, dim=-1, out=s_t)                           # [nt, 2] in one op
        if dots_t is not None:
            _row_dots(e, dots_t, tile_ws.take("product", e.shape[0]) if _elementwise_products(e.device) else None)
    if unshifted:
        lo, hi = _unshifted_window(dtype, width)
        outside = ~((sums >= lo) & (sums <= hi))                # [n, 2], NaN included
        if outside.any():
            for k, src in enumerate((z, z_b)):
                rows = outside[:, k].nonzero().squeeze(1)
                c = src[rows].to(dtype)
                e_r, m_r = torch.empty_like(c), c.new_empty(len(rows))
                _exps_below_max(c, e_r, m_r)
                m[k, rows], exps[rows, k], sums[rows, k] = m_r, e_r, e_r.sum(dim=-1)
            if dots is not None:
                rows = outside.any(dim=1).nonzero().squeeze(1)
                _row_dots(exps[rows], dots_r := dots.new_empty(len(rows), 2, 2))
                dots[rows] = dots_r
    return m, sums.T


def _global_normaliser(every: torch.Tensor):
    """Every rank's row shifts and exp-sums ``every[:, :2]``, ``every[:, 2:4]`` ([TP, >= 4, n]) ->
    the largest shift M and Z = sum_v e^(z_v - M) over all ranks, [2, n] each. A rank's exps
    times exp(m - M) / Z are its part of the global softmax: the exponent is a difference of
    shifts (0 or nearby maxima), where exp(m - log Z) would carry the rounding of log Z
    (~eps |log Z| relative)."""
    big_m = every[:, :2].amax(dim=0)
    return big_m, (every[:, 2:4] * torch.exp(every[:, :2] - big_m)).sum(dim=0)


def _gradient_buffers(z, z_b, valid: int, want: bool, want_base: bool, consume_base: bool):
    """The gradients' [N, V/TP] buffers (None where not wanted), padding columns zeroed; with
    ``consume_base`` the logits' gradient is z_b's storage."""
    grads = [torch.empty_like(x) if w else None for x, w in ((z, want and not consume_base),
                                                              (z_b, want_base))]
    if want and consume_base:
        grads[0] = z_b
    for grad in grads:
        if grad is not None:
            grad[:, valid:] = 0
    return grads


def _divergence_pass(measure: "SeparableMeasure", z, z_b, shard: VocabShard, want: bool,
                     want_base: bool, consume_base: bool = False):
    """Per-token D [N], the per-token gradients dD/dz [N, V/TP], dD/dz_b (None unless wanted)
    of the shards z, z_b [N, V/TP], and their per-row factors (None: 1).

    Per chunk of rows, in cache-sized tiles: (1) shard exps of both logits into one chunk buffer
    [n, 2, V_valid] (p, q) and the factors to the global softmax (one all_gather); (2) rescale
    p, q, f/F/G per logit, row sums; one all-reduce of the sums; (3) gradients F - p sum F and
    G - q sum G. Two collectives per chunk, two exps per logit.
    F and G are written straight into the gradient's rows and finished there in place (into a
    chunk buffer first when the gradient is half precision). ``consume_base``: write dD/dz into
    z_b's storage (each tile's rows of z_b are read before they are written), sparing a fresh
    [N, V/TP] buffer.
    """
    dtype = _compute_dtype(z.dtype)
    valid = shard.valid
    grads = _gradient_buffers(z, z_b, valid, want, want_base, consume_base)
    device = z.device
    values = torch.zeros(z.shape[0], dtype=dtype, device=device)
    # tiles keep a CPU core's cache warm; a GPU kernel takes the whole chunk at once
    tile = rows_per(measure.tile_elements, valid) if device.type == "cpu" else shard.chunk_size
    rows = min(shard.chunk_size, z.shape[0])
    chunk_ws = Workspace(rows, valid, dtype, device)           # F, G if half precision
    pq_ws = Workspace(rows, 2 * valid, dtype, device)          # p, q
    tile_ws = Workspace(min(tile, rows), valid, dtype, device)  # a, b, upcasts, measure scratch
    for rs in shard.chunks(z.shape[0]):
        n = rs.stop - rs.start
        tiles = _divergence_tiles(rs, tile)
        pq = pq_ws.take("pq", n).view(n, 2, valid)
        p, q = pq[:, 0], pq[:, 1]
        # where F, G go: the gradient's own rows, or float32 chunk buffers for a half gradient
        outs = [None if grad is None else (grad[rs, :valid] if grad.dtype == dtype
                                           else chunk_ws.take(name, n))
                for grad, name in zip(grads, ("F", "G"))]
        m, s = _shard_exps(z[rs, :valid], z_b[rs, :valid], pq, tile, tile_ws)
        big_m, big_z = _global_normaliser(_gather_ranks(torch.cat((m, s)), shard.group))
        log_z = big_m + big_z.log()                             # [2, n]
        scale = (torch.exp(m - big_m) / big_z).unsqueeze(-1)    # to the global softmax, [2, n, 1]
        sums = torch.zeros(3, n, dtype=dtype, device=device)    # row sums of f, F, G
        for t, g in tiles:
            if valid == 0:
                break
            nt = t.stop - t.start
            p_t, q_t = p[t].mul_(scale[0, t]), q[t].mul_(scale[1, t])
            a = b = None
            if measure.uses_log_probs:   # read before F overwrites z_b's rows (consume_base)
                a = torch.sub(z[g, :valid], log_z[0, t].unsqueeze(1), out=tile_ws.take("a", nt))
                b = torch.sub(z_b[g, :valid], log_z[1, t].unsqueeze(1), out=tile_ws.take("b", nt))
            out_a, out_b = (None if out is None else out[t] for out in outs)
            f = measure.pointwise(a, b, p_t, q_t, out_a, out_b, tile_ws)
            torch.sum(f, dim=-1, out=sums[0, t])
            for k, out in ((1, out_a), (2, out_b)):
                if out is not None:
                    torch.sum(out, dim=-1, out=sums[k, t])
        sums = _all_reduce(sums, dist.ReduceOp.SUM, shard.group)
        values[rs] = sums[0]
        neg_sums = -sums.unsqueeze(-1)                          # [3, n, 1]
        for t, g in tiles:
            if valid == 0:
                break
            for k, (grad, out, probs) in enumerate(zip(grads, outs, (p, q)), start=1):
                if grad is None:
                    continue
                # F - p sum F (p's chunk buffer is spent after this; addcmul is 4x slower on CPU)
                correction = probs[t].mul_(neg_sums[k, t])
                if out.data_ptr() == grad[rs, :valid].data_ptr():   # in place
                    out[t].add_(correction)
                else:
                    torch.add(out[t], correction, out=grad[g, :valid])
    return values, grads, (None, None)


def _prob_l2_pass(z, z_b, shard: VocabShard, want: bool, want_base: bool,
                  consume_base: bool = False, tile_elements: int = CHUNK_ELEMENTS):
    """ProbL2 D = sum_v (p_v - q_v)^2 per token [N], with its gradients up to per-row factors
    ([N] each: the gradient is factor x buffer), of the shards z, z_b [N, V/TP].

    Closed form, d = p - q, from d p_v / d z_j = p_v ([v = j] - p_j):
        dD/dz_j   =  2 p_j ((p_j - q_j) - sum_v p_v (p_v - q_v)),
        dD/dz^b_j = -2 q_j ((p_j - q_j) - sum_v q_v (p_v - q_v)).
    With e = e^(z - m) on this shard (p = alpha e_p, q = beta e_q; alpha, beta, m per row),
    r = q - p = -d, and P2 = sum p^2, PQ = sum p q, Q2 = sum q^2 over the whole vocabulary:
        dD/dz_j   = -2 alpha * e_p,j (r_j + S),   S = sum_v p_v d_v = P2 - PQ,
        dD/dz^b_j =  2 beta  * e_q,j (r_j + T),   T = sum_v q_v d_v = PQ - Q2,
        D = P2 - 2 PQ + Q2.
    The buffers hold e (r + S), the factors -2 alpha, 2 beta go into the backward's per-row
    scaling (which the upstream gradient needs anyway), and r + S = S - alpha e_p + beta e_q is
    one batched matmul (two multiply-adds on CUDA: _elementwise_products): p and q are never formed.

    Per chunk, in cache-sized tiles: (1) e_p, e_q into one chunk buffer [n, 2, V_valid], their
    shard sums and row dot products (a batched matmul, which reads each entry once and writes
    nothing else); one all_gather of maxima, sums and dot products [8, n] gives alpha, beta,
    S, T and D; (2) r + S (a batched matmul with K = 2) times e_p into the buffer, written once
    (into z_b's rows with ``consume_base``: read in (1), written in (2)). One collective per
    chunk, two exps per logit; at 32k columns per shard every op is bound by memory bandwidth
    (L2 included), so the pass minimises bytes moved per logit (docs/performance.md).

    Rounding: S, T and D come from dot products, so they err by ~eps (P2 + Q2) in absolute
    terms (float32: ~1e-7 for a peaked distribution), where an elementwise p - q errs by ~eps
    |p - q|; near-identical peaked distributions thus get D, and the gradient's S term, to
    ~1e-7 absolute in float32 (docs/vocab_parallel.md). D is clamped at 0, and exactly 0 for
    identical logits. Summing |r|^2 elementwise instead costs two more passes per logit
    (+0.1x megatron's cross-entropy time, measured).
    """
    dtype, valid, device = _compute_dtype(z.dtype), shard.valid, z.device
    grads = _gradient_buffers(z, z_b, valid, want, want_base, consume_base)
    rows = z.shape[0]
    values = torch.empty(rows, dtype=dtype, device=device)
    factors = [None if grad is None else torch.empty(rows, dtype=dtype, device=device) for grad in grads]
    tile = rows_per(tile_elements, valid) if device.type == "cpu" else shard.chunk_size
    n_max = min(shard.chunk_size, rows)
    stack_ws = Workspace(n_max, 2 * valid, dtype, device)      # e_p, e_q of a chunk
    tile_ws = Workspace(min(tile, n_max), valid, dtype, device)   # r + S, upcasts
    dots = torch.zeros(n_max, 2, 2, dtype=dtype, device=device)   # stays 0 on a padding-only shard
    elementwise = _elementwise_products(device)
    for rs in shard.chunks(rows):
        n = rs.stop - rs.start
        e = stack_ws.take("e", n).view(n, 2, valid)
        m, s = _shard_exps(z[rs, :valid], z_b[rs, :valid], e, tile, tile_ws, dots[:n])
        every = _gather_ranks(torch.cat((m, s, dots[:n].reshape(n, 4).T)), shard.group)  # [TP, 8, n]
        big_m, big_z = _global_normaliser(every)
        # every rank's alpha, beta ([TP, 2, n]) weight its dot products: [[P2, PQ], [PQ, Q2]] per row
        u = torch.exp(every[:, :2] - big_m) / big_z
        sums = (u.unsqueeze(2) * u.unsqueeze(1) * every[:, 4:].view(-1, 2, 2, n)).sum(0)   # [2, 2, n]
        p2, pq, q2 = sums[0, 0], sums[0, 1], sums[1, 1]
        torch.clamp_min(p2 - 2 * pq + q2, 0, out=values[rs])
        scale = torch.exp(m - big_m) / big_z                    # this rank's alpha, beta: [2, n]
        for factor, sign, k in zip(factors, (-2, 2), (0, 1)):
            if factor is not None:
                torch.mul(scale[k], sign, out=factor[rs])
        if valid == 0 or grads == [None, None]:
            continue
        coef = torch.stack((-scale[0], scale[1]), dim=-1).unsqueeze(1)   # [n, 1, 2]
        totals = (p2 - pq, pq - q2)                                       # S, T
        outs = [None if grad is None else (grad[rs, :valid].split(tile), totals[k].unsqueeze(1).split(tile))
                for k, grad in enumerate(grads)]
        for i, (e_t, coef_t) in enumerate(zip(e.split(tile), coef.split(tile))):
            nt = e_t.shape[0]
            for k, out in enumerate(outs):
                if out is None:
                    continue
                grad_t, total_t = out[0][i], out[1][i]
                if elementwise:                                                 # r + S or r + T
                    h = torch.addcmul(total_t, coef_t[:, 0, :1], e_t[:, 0], out=tile_ws.take("h", nt))
                    h.addcmul_(coef_t[:, 0, 1:], e_t[:, 1])
                else:
                    h = torch.baddbmm(total_t.unsqueeze(1), coef_t, e_t, out=tile_ws.take("h", nt).unsqueeze(1))[:, 0]
                if grad_t.dtype == dtype:
                    torch.mul(h, e_t[:, k], out=grad_t)
                else:
                    grad_t.copy_(h.mul_(e_t[:, k]))
    return values, grads, factors


class _FullVocabDivergence(torch.autograd.Function):
    """D per token from the logit shards of the current (p) and base (q) policies, by a pass
    ``divergence_pass(z, z_b, shard, want, want_base, consume_base) -> (values, grads, factors)``
    that computes the per-token gradients in the forward, while p and q are at hand (a per-row
    ``factor`` [N] scales a gradient buffer; None: 1). D is a loss term (all that follows is a
    per-token weight g), so the backward only scales rows by g (x factor) in place: two exps per
    logit in all, where a recomputing backward needs four. The buffers exist only for inputs that
    require grad (compute metrics under no_grad). A second backward through the same graph
    (retain_graph, gradcheck) finds the buffers consumed and recomputes them from the logits,
    provided those were not modified since.
    """

    @staticmethod
    def forward(ctx, logits, logits_base, divergence_pass, shard: VocabShard, consume_base: bool):
        if logits.shape != logits_base.shape:
            raise ValueError(f"logits {tuple(logits.shape)} and logits_base "
                             f"{tuple(logits_base.shape)} differ in shape")
        z = logits.reshape(-1, logits.shape[-1])                # [N, V/TP]
        z_b = logits_base.reshape(-1, logits_base.shape[-1])
        if consume_base and (ctx.needs_input_grad[1] or z_b.dtype != z.dtype):
            raise ValueError("consume_base needs a base that requires no grad, of the logits' dtype")
        values, *grads = divergence_pass(z, z_b, shard, *ctx.needs_input_grad[:2], consume_base)
        ctx.grads = grads                                       # [buffers, factors]
        # Not save_for_backward: the fast path never reads the logits, and an in-place backward of
        # another function on the same logits (log_probs_and_entropy) must not trip the check.
        ctx.inputs = (z, z_b, logits._version, logits_base._version)
        ctx.divergence_pass, ctx.shard = divergence_pass, shard
        ctx.shapes = (logits.shape, logits_base.shape)
        return values.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, g):
        if ctx.grads is None:
            z, z_b, version, version_b = ctx.inputs
            if (z._version, z_b._version) != (version, version_b):
                raise RuntimeError("a second backward through a full-vocabulary divergence needs "
                                   "its logits, which were modified in place after the forward")
            ctx.grads = ctx.divergence_pass(z, z_b, ctx.shard, *ctx.needs_input_grad[:2])[1:]
        grads, factors = ctx.grads
        ctx.grads = None
        g = g.reshape(-1)
        for grad, factor in zip(grads, factors):
            if grad is None:
                continue
            scale = (g if factor is None else g * factor).unsqueeze(1)
            if grad.dtype == scale.dtype:
                grad.mul_(scale)
                continue
            # a half-precision gradient times the float32 scale: in float32, by chunks, then rounded
            ws = Workspace(min(ctx.shard.chunk_size, grad.shape[0]), grad.shape[1], scale.dtype,
                           grad.device)
            for rs in ctx.shard.chunks(grad.shape[0]):
                grad[rs] = torch.mul(grad[rs], scale[rs], out=ws.take("scaled", rs.stop - rs.start))
        return (*(None if grad is None else grad.view(shape)
                  for grad, shape in zip(grads, ctx.shapes)), None, None, None)


class SeparableMeasure(Protocol):
    """What :func:`separable_divergence` needs of a measure D = sum_v f(a_v, b_v)."""

    uses_log_probs: bool
    """Whether ``pointwise`` reads a = log p and b = log q (else it gets None for both)."""
    tile_elements: int
    """Logits per call of ``pointwise`` (its temporaries should fit in cache): CHUNK_ELEMENTS."""

    def pointwise(self, a, b, p, q, out_a, out_b, ws: Workspace):
        """f elementwise on a tile [rows, V_valid], returned (it may live in ``ws``); writes df/da
        into ``out_a`` and df/db into ``out_b`` (each None when not wanted). Scratch comes from
        ``ws.take(name, rows)``; a and b are scratch too and may be overwritten; p, q may not."""


def separable_divergence(measure: SeparableMeasure, logits: torch.Tensor, logits_base: torch.Tensor,
                         group=None, vocab_start: int = 0, vocab_size: int | None = None,
                         chunk_size: int | None = None, consume_base: bool = False) -> torch.Tensor:
    """sum_v f(log p_v, log q_v) per token ([...]) from logit shards [..., V/TP] of the current
    (p) and base (q) policies; gradients flow to both (the base's only if it requires grad).

    ``consume_base=True`` reuses the base logits' storage for the gradient of ``logits`` (their
    values are destroyed during this call, as megatron-core's cross entropy destroys its input):
    for a reference whose logits serve nothing else; the base must not require grad.
    """
    shard = VocabShard.of(logits, group, vocab_start, vocab_size, chunk_size, DIVERGENCE_CHUNK_BYTES)
    return _FullVocabDivergence.apply(logits, logits_base, partial(_divergence_pass, measure), shard,
                                      consume_base)


def prob_l2_divergence(logits: torch.Tensor, logits_base: torch.Tensor, group=None,
                       vocab_start: int = 0, vocab_size: int | None = None,
                       chunk_size: int | None = None, consume_base: bool = False,
                       tile_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """sum_v (p_v - q_v)^2 per token ([...]) from logit shards [..., V/TP]; as
    :func:`separable_divergence` with f = (p - q)^2, by the closed-form pass ``_prob_l2_pass``."""
    shard = VocabShard.of(logits, group, vocab_start, vocab_size, chunk_size, DIVERGENCE_CHUNK_BYTES)
    return _FullVocabDivergence.apply(logits, logits_base,
                                      partial(_prob_l2_pass, tile_elements=tile_elements), shard,
                                      consume_base)

