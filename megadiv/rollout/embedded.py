"""EmbeddedEngine: the rollout protocol in the trainer's own process, with transformers.

For small models and machines without a GPU (the CPU default). The HF model is kept in sync from
the same weight buckets the SGLang engine receives: each tensor is copied into the parameter of
the same HF name. float32 on CPU, the checkpoint's dtype on GPU.

Log-probs follow the protocol's convention (megadiv.rollout.engine): from generate's raw logits
(``output_logits``, before temperature / top-p / top-k processors) as log_softmax(logits / T).
Memory: generate holds [rows, new tokens, vocab] logits until it returns, which is what limits
this engine to small models and batches.
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from megadiv.rollout.config import RolloutConfig
from megadiv.rollout.engine import (
    Bucket,
    Completion,
    RolloutError,
    SamplingParams,
    SyncReport,
    WeightSyncError,
    check_prompts,
)


class EmbeddedEngine:
    def __init__(self, hf_dir: str, cfg: RolloutConfig | None = None):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg or RolloutConfig(engine="embedded")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = "auto" if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(self.device).eval()
        # remove_duplicate=False: a tied lm_head.weight is listed too (the same Parameter)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self._eos = set([eos] if isinstance(eos, int) else (eos or []))
        self._pad = gen.pad_token_id if gen.pad_token_id is not None else min(self._eos, default=0)
        self._version = "default"
        self._paused = False

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        from transformers import GenerationConfig

        check_prompts(prompts)
        self._check_not_paused()
        rows = [list(p) for p in prompts for _ in range(params.n)]  # [prompt0 x n, prompt1 x n, ...]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self._pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):  # left padding: every row's last prompt token at column width - 1
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        stop = self._eos | set(params.stop_token_ids)
        greedy = params.temperature == 0
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy or params.top_p == 1.0 else params.top_p,  # None: no top-p warper (a sort per step)
            top_k=None if greedy or params.top_k == -1 else params.top_k,  # None: no top-k warper
            eos_token_id=sorted(stop), pad_token_id=self._pad,
            output_logits=True, return_dict_in_generate=True)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  generation_config=config)
        new = out.sequences[:, width:].cpu()  # [rows, steps]
        logits = torch.stack(out.logits, dim=1).float()  # [rows, steps, vocab], raw (before processors)
        logp = F.log_softmax(logits / (1.0 if greedy else params.temperature), dim=-1)
        token_logp = logp.gather(-1, new.to(logp.device).unsqueeze(-1)).squeeze(-1).cpu()  # [rows, steps]
        completions = []
        for i in range(len(rows)):
            tokens = new[i].tolist()
            end = next((j + 1 for j, t in enumerate(tokens) if t in stop), None)  # keep the stop token
            reason = "stop" if end is not None else "length"
            end = end or len(tokens)
            completions.append(Completion(tokens[:end], token_logp[i, :end].tolist(), reason, self._version))
        return [completions[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

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
    def update_weights(self, buckets: Iterable[Bucket], version: str) -> SyncReport:
        t0 = time.perf_counter()
        n_tensors = n_buckets = n_bytes = 0
        for i, bucket in enumerate(buckets):
            where = f"weight sync to version {version!r} (embedded engine), bucket {i}"
            for name, t in bucket:  # check the whole bucket before changing anything in it
                if name not in self._params:
                    raise WeightSyncError(f"{where}: tensor {name!r} is not a weight of the model")
                if tuple(t.shape) != tuple(self._params[name].shape):
                    raise WeightSyncError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the model's is "
                                          f"{tuple(self._params[name].shape)}")
            for name, t in bucket:
                self._params[name].copy_(t)
            n_buckets, n_tensors = n_buckets + 1, n_tensors + len(bucket)
            n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        self._version = version
        return SyncReport(version, "embedded", n_tensors, n_buckets, n_bytes, time.perf_counter() - t0)

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    @property
    def weight_version(self) -> str:
        return self._version

    def shutdown(self) -> None:
        self.model = None
        self._params = {}

    def _check_not_paused(self) -> None:
        if self._paused:
            raise RolloutError("the engine is paused: call resume() before generate()/score()")
        if self.model is None:
            raise RolloutError("the engine was shut down")
