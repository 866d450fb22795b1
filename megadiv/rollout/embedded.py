"""EmbeddedEngine: the rollout protocol in the trainer's own process, with transformers.

For small models and machines without a GPU (the CPU default). The HF model is kept in sync from
the same weight buckets the SGLang engine receives: each tensor is copied into the parameter of
the same HF name, or, with ``update_weights(..., share=True)``, taken as the parameter itself (a
view of the trainer's parameter: no copy, and no copy to refresh). float32 on CPU, the
checkpoint's dtype on GPU. A mixture-of-experts layer's experts, which transformers keeps fused
in memory, are sent per expert under the checkpoint's names and copied into their slices
(:func:`fused_expert_slices`).

Sampling is seeded per row, not per call: row r of a call (prompt i, sample j; r = i * n + j
counted from ``first_prompt``) draws each token from one uniform that is a function of (call
seed, r, token position) alone (:class:`RowSeededSampler`, inverse CDF), so the prompts of one
call can be split over engines (:class:`RankSplitEngine`: one per trainer rank) and give the
completions one engine gives.

Log-probs follow the protocol's convention (megadiv.rollout.engine): from generate's raw logits
(before temperature / top-p / top-k processors) as log_softmax(logits / T), taken step by step
by the first logits processor (:class:`ChosenLogProbs`), so a call holds one step's
[rows, vocab] log-probs, not every step's logits.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megadiv.parallel import cpu_compat
from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import (
    Bucket,
    Completion,
    RolloutError,
    SamplingParams,
    SyncReport,
    WeightSyncError,
    check_prompts,
    split_evenly,
)
from megadiv.rollout.stream import WaveStream


class EmbeddedEngine:
    def __init__(self, hf_dir: str, cfg: RolloutConfig | None = None):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg or RolloutConfig(engine="embedded")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = "auto" if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)  # the engine never trains: no graph, shared weights stay read-only
        # remove_duplicate=False: a tied lm_head.weight is listed too (the same Parameter)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._slices = fused_expert_slices(self.model)
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self._eos = set([eos] if isinstance(eos, int) else (eos or []))
        self._pad = gen.pad_token_id if gen.pad_token_id is not None else min(self._eos, default=0)
        self._version = "default"
        self._paused = False
        self._borrowed: set[int] = set()  # ids of parameters whose storage is a tensor given with share=True

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, seed: int | None = None,
                 first_prompt: int = 0) -> list[list[Completion]]:
        """The protocol's generate. ``seed``: the call's sampling seed (None: drawn from torch's
        global generator, so torch.manual_seed makes a call reproducible); ``first_prompt``: the
        index of prompts[0] in the call it is a slice of (row seeds: module docstring)."""
        from transformers import GenerationConfig, LogitsProcessorList

        check_prompts(prompts)
        self._check_not_paused()
        seed = draw_seed() if seed is None else seed
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):  # left padding: every row's last prompt token at column width - 1
            ids[i, width - len(prompt):] = torch.tensor(list(prompt))
            mask[i, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        stop = self._eos | set(params.stop_token_ids)
        greedy = params.temperature == 0
        # do_sample=False always: a sampled call picks the argmax of what RowSeededSampler returns (its
        # row's draw from the tempered, truncated softmax: an exact sample), greedy the plain argmax
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=False, eos_token_id=sorted(stop),
            pad_token_id=self._pad, return_dict_in_generate=True)
        row_ids = torch.arange(first_prompt * params.n, (first_prompt + len(prompts)) * params.n)
        chosen = ChosenLogProbs(1.0 if greedy else params.temperature)
        processors = LogitsProcessorList([chosen] + ([] if greedy else sampling_processors(params, seed, row_ids, width)))
        routed = RoutedExperts(self.model) if params.return_routing else nullcontext()
        with cpu_compat.paused(), routed:  # transformers' code needs none of megatron's CPU redirections
            cache = self._prefill(ids[:, :-1], mask[:, :-1], params.n) if params.n > 1 and width > 1 else None
            ids, mask = ids.repeat_interleave(params.n, 0), mask.repeat_interleave(params.n, 0)  # [p0 x n, ..]
            out = self.model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                                      generation_config=config, logits_processor=processors)
        new = out.sequences[:, width:]  # [rows, steps]
        token_logp = chosen.finish(new).cpu()
        new = new.cpu()
        # [rows, width + steps - 1, layers, k]: every column the engine ran (the prefill's prompts repeated n times)
        routing = routed.columns(len(ids)) if params.return_routing else None
        completions = []
        for i in range(len(ids)):
            tokens = new[i].tolist()
            end = next((j + 1 for j, t in enumerate(tokens) if t in stop), None)  # keep the stop token
            reason = "stop" if end is not None else "length"
            end = end or len(tokens)
            prompt = len(prompts[i // params.n])  # left-padded: its columns are width - prompt .. width - 1
            completions.append(Completion(
                tokens[:end], token_logp[i, :end].tolist(), reason, self._version,
                routing=None if routing is None else routing[i, width - prompt:width + end - 1].clone()))
        return [completions[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, n: int):
        """The KV cache of each distinct prompt's first width - 1 columns, computed once and repeated
        for its n samples (generate then runs only the last prompt column for every row): the
        prompt's share of the work divided by n, as SGLang's and vLLM's prefix caches do. Position ids
        as generate makes them from the mask (0-based over real tokens, pads 0), so the cached keys
        are the ones generate would have computed, to float32 rounding (a different batch size)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                   logits_to_keep=1)
        cache.batch_repeat_interleave(n)
        return cache

    @torch.no_grad()
    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        check_prompts(prompts)
        self._check_not_paused()
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self._pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):  # right padding: positions 0..len-1 as in an unpadded forward
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        with cpu_compat.paused():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits.float()
        logp = F.log_softmax(logits, dim=-1)  # [batch, width, vocab]
        out = []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            # logits at position t predict token t + 1: response token j sits at len(p) + j
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(r), device=logp.device)
            target = torch.tensor(list(r), dtype=torch.long, device=logp.device)
            out.append(logp[i, pos, target].cpu())
        return out

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Bucket], version: str, share: bool = False) -> SyncReport:
        """The protocol's update_weights; ``share=True`` takes each tensor as the parameter's storage
        (no copy) when its dtype and device are the model's, and copies it otherwise. A shared view
        of a trainer parameter serves the parameter's values as they change: the caller must not
        change them while a generate or score call runs (no overlap), and the engine never writes
        into a shared tensor (a later copy gives the parameter storage of its own again)."""
        t0 = time.perf_counter()
        n_tensors = n_buckets = n_bytes = 0
        for i, bucket in enumerate(buckets):
            where = f"weight sync to version {version!r} (embedded engine), bucket {i}"
            for name, t in bucket:  # check the whole bucket before changing anything in it
                target = self._params.get(name, self._slices.get(name))
                if target is None:
                    raise WeightSyncError(f"{where}: tensor {name!r} is not a weight of the model")
                if tuple(t.shape) != tuple(target.shape):
                    raise WeightSyncError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the model's is "
                                          f"{tuple(target.shape)}")
            for name, t in bucket:
                if name in self._slices:  # one expert's part of a fused tensor: always a copy
                    self._slices[name].copy_(t)
                    continue
                p = self._params[name]  # tied weights: one Parameter under both names
                if share and (t.dtype, t.device) == (p.dtype, p.device):
                    p.data = t.detach()
                    self._borrowed.add(id(p))
                elif id(p) in self._borrowed:  # never copy into a tensor the trainer owns
                    p.data = t.detach().to(device=p.device, dtype=p.dtype, copy=True)
                    self._borrowed.discard(id(p))
                else:
                    p.copy_(t)
            n_buckets, n_tensors = n_buckets + 1, n_tensors + len(bucket)
            n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        self._version = version
        return SyncReport(version, "embedded-shared" if share else "embedded", n_tensors, n_buckets, n_bytes,
                          time.perf_counter() - t0)

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    @property
    def weight_version(self) -> str:
        return self._version

    def serve(self, group) -> None:
        """A rank other than 0 of a RankSplitEngine's ``group``: generate this rank's slice of each
        of rank 0's calls until it releases the ranks. A failure is sent to rank 0, which raises it
        naming this rank."""
        while True:
            box = [None]
            dist.scatter_object_list(box, None, src=0, group=group)
            if box[0] is None:
                return
            prompts, params, seed, first = box[0]
            try:
                out = self.generate(prompts, params, seed=seed, first_prompt=first) if prompts else []
            except Exception as e:  # handed to rank 0 (as a RolloutError: always picklable), which raises it
                out = RolloutError(f"{type(e).__name__}: {e}")
            dist.gather_object(out, None, dst=0, group=group)

    def open_stream(self, params: SamplingParams) -> WaveStream:
        """Groups generated in waves, one batch generate call each (rollout/stream.py)."""
        return WaveStream(self, params)

    def shutdown(self) -> None:
        self.model = None
        self._params = {}
        self._borrowed = set()

    def _check_not_paused(self) -> None:
        if self._paused:
            raise RolloutError("the engine is paused: call resume() before generate()/score()")
        if self.model is None:
            raise RolloutError("the engine was shut down")


# --------------------------------------------------------------------------- seeded sampling


class RoutedExperts:
    """Inside a with-block, the experts every MoE block of a transformers model routes each
    position to: a forward hook on each block's router (``mlp.gate``, whose forward returns
    (logits, scores, top-k indices) for the [rows x seq, H] it is given) and on the block, which
    sees the [rows, seq, H] shape. :meth:`columns` joins the forwards along the sequence."""

    def __init__(self, model: torch.nn.Module):
        self.blocks = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        if not self.blocks:
            raise RolloutError(f"{type(model).__name__} has no mixture-of-experts blocks: no routing to return")
        self.chosen: list[torch.Tensor] = []  # per forward, per block: [rows, seq, k]
        self._last: torch.Tensor | None = None

    def __enter__(self) -> "RoutedExperts":
        def gate(module, args, output):
            self._last = output[2]

        def block(module, args, output):
            self.chosen.append(self._last.view(*args[0].shape[:2], -1).to(torch.int16).cpu())

        self._handles = [h for b in self.blocks
                         for h in (b.gate.register_forward_hook(gate), b.register_forward_hook(block))]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def columns(self, rows: int) -> torch.Tensor:
        """[rows, columns, layers, k]: the forwards in order, each [r, seq] (a prefill of the distinct
        prompts, r = rows / n, is repeated for their n samples)."""
        layers = len(self.blocks)
        forwards = [torch.stack(self.chosen[f:f + layers], 2) for f in range(0, len(self.chosen), layers)]
        return torch.cat([x.repeat_interleave(rows // len(x), 0) for x in forwards], 1)


def fused_expert_slices(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF checkpoint name -> the slice of a fused expert tensor it fills, for every module that
    holds its experts as ``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F] (transformers 5's
    Qwen3MoeExperts and kin, whose forward takes gate, up = (x @ gate_up_proj[g].T).chunk(2)):
    ``{prefix}.{g}.gate_proj.weight`` is gate_up_proj[g, :F], ``up_proj`` gate_up_proj[g, F:] and
    ``down_proj`` down_proj[g]. Views of the parameters' storage, which the engine never replaces
    for these (they are copied into, never shared)."""
    out = {}
    for prefix, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
                and gate_up.dim() == down.dim() == 3):
            continue
        ffn = gate_up.shape[1] // 2
        for g in range(gate_up.shape[0]):
            out |= {f"{prefix}.{g}.gate_proj.weight": gate_up.data[g, :ffn],
                    f"{prefix}.{g}.up_proj.weight": gate_up.data[g, ffn:],
                    f"{prefix}.{g}.down_proj.weight": down.data[g]}
    return out


def draw_seed() -> int:
    """A call's sampling seed from torch's global generator (what torch.manual_seed fixes)."""
    return int(torch.randint(0, 2**62, ()))


def sampling_processors(params: SamplingParams, seed: int, row_ids: torch.Tensor, width: int) -> list:
    """Temperature, top-k, top-p (transformers' warpers, in the order its sampling applies them),
    then each row's own draw from the result (RowSeededSampler), which generate's argmax picks."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
    if params.top_k != -1:
        out.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(params.top_p))
    return out + [RowSeededSampler(seed, row_ids, width)]


class RowSeededSampler:
    """Draws each row's next token from softmax(processed logits) by inverting its CDF at one
    uniform u, and returns scores whose argmax is that token (0 there, -inf elsewhere). u is a
    function of (seed, row r, generated position t) alone, so a row samples the same tokens
    whatever batch it is in.

    The uniforms come from a counter-based hash (32-bit lowbias32 rounds, exact in int64 on any
    device) instead of torch generators: one generator per row would cost a call per row and step.
    One uniform per row and step, not one per token (Gumbel-max): at a 49k vocabulary hashing
    every token cost 0.6 s per step of 128 rows, the inversion costs ~0.02 s."""

    def __init__(self, seed: int, row_ids: torch.Tensor, width: int):
        self.seed, self.row_ids, self.width = seed, row_ids, width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width  # position of the token being chosen, 0 first
        u = hashed_uniforms(self.seed, self.row_ids.to(scores.device), step)  # [rows]
        weights = (scores - scores.amax(-1, keepdim=True)).exp()  # softmax up to its sum; -inf -> 0
        token = inverse_cdf_sample(weights, u)
        return torch.full_like(scores, float("-inf")).scatter_(-1, token[:, None], 0.0)


class ChosenLogProbs:
    """The first logits processor of a generate call: the log-prob of each row's chosen token under
    log_softmax(raw logits / T). It sees the raw logits of step t (nothing runs before it) and keeps
    their log-probs until step t + 1, whose input ends in the token chosen at t; :meth:`finish`
    takes the last step's from the generated tokens. One [rows, vocab] tensor is held at a time
    (keeping every step's logits for the end held [rows, new tokens, vocab]: 3.2 GB for 128 rows x
    128 tokens at a 49k vocabulary)."""

    def __init__(self, temperature: float):
        self.temperature, self.pending, self.steps = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self._take(input_ids[:, -1])
        self.pending = F.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        self.steps.append(self.pending.gather(-1, tokens.to(self.pending.device)[:, None])[:, 0])
        self.pending = None

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[rows, steps] log-probs of ``new_tokens`` (generate's tokens after the prompt)."""
        if self.pending is not None:
            self._take(new_tokens[:, len(self.steps)])
        if len(self.steps) != new_tokens.shape[1]:
            raise RolloutError(f"generate chose {new_tokens.shape[1]} tokens but ran the logits processors "
                               f"{len(self.steps)} times")
        return torch.stack(self.steps, dim=1)


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """[rows, V] non-negative weights (each row with a positive sum), [rows] float64 uniforms in
    (0, 1) -> [rows] the token i with C(i - 1) <= u C(V) < C(i), C the row's cumulative weights: a
    sample of weights / sum. In two levels, so that no [rows, V] float64 or sequential float32 cumsum is
    made: float64 cumulative sums of the float32 sums of blocks of ``block`` tokens pick the block,
    a float64 cumsum inside it the token. Rounding between the two levels can put the target just
    outside the block's mass: it is clamped to the block's first and last token of positive weight,
    so a token of weight 0 (top-k / top-p, padding) is never returned."""
    rows, vocab = weights.shape
    blocks = F.pad(weights, (0, -vocab % block)).view(rows, -1, block)
    ends = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [rows, blocks]: mass up to each block's end
    target = u[:, None] * ends[:, -1:]  # in (0, total)
    b = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[1] - 1)  # first end > target
    start = torch.where(b > 0, ends.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    inside = blocks[torch.arange(rows, device=weights.device), b[:, 0]]  # [rows, block]
    j = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64), (target - start).clamp(min=0), right=True)
    positions = torch.arange(block, device=weights.device)
    last = torch.where(inside > 0, positions, -1).amax(-1, keepdim=True)
    return (b * block + torch.minimum(j, last))[:, 0]


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x, c in [0, 2**32): the int64 product wraps modulo 2**64 (torch's integer
    multiply is two's complement), which keeps its low 32 bits exact; one multiply, not three."""
    return (x * c) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' hash-prospector): a bijection of [0, 2**32) with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hashed_uniforms(seed: int, rows: torch.Tensor, step: int) -> torch.Tensor:
    """[len(rows)] float64 uniforms in (0, 1) with 53 random bits, a function of (seed, row, step)
    alone: two chained 32-bit keys per row and step (a bijective chain: distinct rows, distinct
    first keys), 32 + 21 bits of them."""
    base = _mix32(_mix32(torch.tensor(seed & _M32)) ^ ((seed >> 32) & _M32))
    k1 = _mix32(_mix32(base ^ (rows & _M32)) ^ (step & _M32))
    k2 = _mix32(k1 ^ 0x9E3779B9)
    return ((k1 << 21 | k2 >> 11).double() + 0.5) / 2.0**53


# --------------------------------------------------------------------------- generation on every rank


class RankSplitEngine:
    """Rank 0's engine when embedded generation is spread over the trainer's ranks: every rank of
    ``group`` holds an EmbeddedEngine; a generate call draws one seed, sends each rank a contiguous
    slice of the prompts (sizes differing by at most one, rank 0 first) and gathers the slices
    back in prompt order; the other ranks answer in :meth:`EmbeddedEngine.serve` until :meth:`release`.
    By the row seeds the result equals one engine's generate(prompts, params, seed=seed).

    score, weight updates, pause and the version are rank 0's own engine's: every rank updates its
    own engine from its own export (each rank receives the whole model), and checks it with the probe."""

    def __init__(self, local: EmbeddedEngine, group):
        self.local, self.group = local, group
        self.world = dist.get_world_size(group)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        check_prompts(prompts)
        self.local._check_not_paused()
        seed = draw_seed()
        slices = split_evenly(len(prompts), self.world)
        requests = [(list(prompts[s]), params, seed, s.start) for s in slices]
        dist.scatter_object_list([None], requests, src=0, group=self.group)
        failure = None
        try:
            out = self.local.generate(requests[0][0], params, seed=seed)  # slice 0 is never empty
        except Exception as e:  # raised after the gather, so that the other ranks are back in serve()
            out, failure = None, e
        gathered = [None] * self.world
        dist.gather_object(out, gathered, dst=0, group=self.group)
        if failure is not None:
            raise failure
        for rank, part in enumerate(gathered):
            if isinstance(part, BaseException):
                raise RolloutError(f"embedded generation on rank {rank} failed: {part}") from part
        return [group for part in gathered for group in part]

    def release(self) -> None:
        """End the other ranks' EmbeddedEngine.serve (after the last generate call of a phase)."""
        dist.scatter_object_list([None], [None] * self.world, src=0, group=self.group)

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return self.local.score(prompts, responses)

    def update_weights(self, buckets: Iterable[Bucket], version: str, share: bool = False) -> SyncReport:
        return self.local.update_weights(buckets, version, share)

    def pause(self) -> None:
        self.local.pause()

    def resume(self) -> None:
        self.local.resume()

    @property
    def weight_version(self) -> str:
        return self.local.weight_version

    def open_stream(self, params: SamplingParams) -> WaveStream:
        """Groups generated in waves, one batch generate call each (rollout/stream.py)."""
        return WaveStream(self, params)

    def shutdown(self) -> None:
        self.local.shutdown()
