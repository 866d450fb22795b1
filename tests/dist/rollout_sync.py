"""Rank body for tests/test_rollout.py: a TP=2 Megatron actor pushes its weights into a running
SGLang server and the server's log-probs are compared with the actor's own.

Both ranks build the actor from the tiny HF checkpoint the server started with, perturb it (the
same noise on both ranks, so replicated parameters stay identical), and export it with
``iter_hf_weight_buckets`` (collective); rank 0 alone talks to the server.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.gpt_models[0].named_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _actor_logprobs(model, prompts, responses, temperature: float = 1.0) -> list[torch.Tensor]:
    """log_softmax(logits / T) of each response token under the TP=2 actor (collective over TP):
    one unpadded forward per sequence; logits [1, s, V_pad/TP] gathered to [1, s, V_pad]."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    gpt = model.gpt_models[0]
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            tokens = torch.tensor([list(p) + list(r)])
            positions = torch.arange(tokens.shape[1]).unsqueeze(0)
            logits = gather_from_tensor_model_parallel_region(gpt(tokens, positions, attention_mask=None))
            logp = F.log_softmax(logits[0, :, :model.vocab_size].float() / temperature, dim=-1)
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(r))
            out.append(logp[pos, torch.tensor(list(r))])
    return out


def sync_to_sglang(ctx):
    from megadiv.config import ParallelConfig
    from megadiv.models import build_model, iter_hf_weight_buckets
    from megadiv.parallel import initialize
    from megadiv.rollout import RolloutConfig, SamplingParams, check_mismatch
    from megadiv.rollout.sglang_engine import SGLangEngine
    from tests.test_rollout import random_probe

    hf_dir, url = ctx.args["hf_dir"], ctx.args["url"]
    info = initialize(ParallelConfig(tensor_parallel=2), seed=0)
    model = build_model(hf_dir, "actor")
    cfg = RolloutConfig(engine="sglang", server_urls=(url,), bucket_bytes=ctx.args["bucket_bytes"],
                        sync_timeout_s=120, request_timeout_s=120)
    probe = random_probe(seed=0)
    engine = SGLangEngine(hf_dir, cfg) if info.rank == 0 else None
    figures = {"tp_size": info.tp_size}

    for step, method in enumerate(("distributed", "disk"), start=1):
        _perturb(model, seed=step)
        actor = _actor_logprobs(model, probe.prompts, probe.responses)
        buckets = iter_hf_weight_buckets(model, cfg.bucket_bytes)
        if engine is None:
            for _ in buckets:  # the export is collective: rank 1 gathers with rank 0
                pass
            continue
        engine.cfg = dataclasses.replace(cfg, sync_method=method)
        version = f"step-{step}"
        stale = check_mismatch(engine, probe, actor, float("inf"), version)  # before the push: old weights
        report = engine.update_weights(buckets, version)
        fresh = check_mismatch(engine, probe, actor, 1e-4, version)
        figures[method] = {"before_max": stale.max_abs, "after_max": fresh.max_abs, "after_mean": fresh.mean_abs,
                           "buckets": report.num_buckets, "tensors": report.num_tensors, "bytes": report.bytes,
                           "version": engine.weight_version}

    # the log-probs SGLang returns while sampling follow the same convention (T = 0.7 here)
    params = SamplingParams(n=2, temperature=0.7, top_k=20, max_new_tokens=12)
    prompts = probe.prompts[:2]
    sampled = [None]
    if engine is not None:
        groups = engine.generate(prompts, params)
        sampled = [[(i, c.token_ids, c.logprobs, c.weight_version) for i, g in enumerate(groups) for c in g]]
    dist.broadcast_object_list(sampled, src=0)
    rows = sampled[0]
    actor = _actor_logprobs(model, [prompts[i] for i, *_ in rows], [t for _, t, *_ in rows], temperature=0.7)
    if engine is not None:
        figures["generate_max"] = max(float((a - torch.tensor(lp)).abs().max()) for a, (_, _, lp, _) in zip(actor, rows))
        figures["generate_versions"] = sorted({v for *_, v in rows})
        figures["generated_tokens"] = sum(len(t) for _, t, *_ in rows)
        engine.shutdown()  # attached: leaves the server running, destroys the weight-update group
    return figures
