"""Where the policy starts: the configured checkpoint, or (demos) a tiny random model that a brief
supervised warm start teaches the task's answer format, so that GRPO has reward signal.

The warm-started policy is written to ``run_dir/sft`` as a Hugging Face checkpoint; the actor,
the reference model and the rollout engine all start from it, and a resumed run reuses it.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch.distributed as dist

from megadiv.config import ModelConfig, OptimConfig
from megadiv.data import PromptSampler, PromptTemplate, load_dataset
from megadiv.parallel import ParallelInfo
from megadiv.policy.batches import SequenceBatch
from megadiv.policy.objectives import sft_objective
from megadiv.progress import Progress
from megadiv.trainer.backend import make_policy
from megadiv.trainer.config import TrainConfig
from megadiv.trainer.lifecycle import NonFiniteError

log = logging.getLogger(__name__)


def starting_checkpoint(cfg: TrainConfig, run_dir: Path, info: ParallelInfo) -> str:
    """The HF directory the run starts from (collective)."""
    hf_dir = cfg.model.hf_dir
    if cfg.warm_start.make_model != "none" and not cfg.model.has_checkpoint():
        if info.rank == 0:
            _make_model(cfg)
        dist.barrier()
    if cfg.warm_start.sft_steps == 0:
        return hf_dir
    sft_dir = run_dir / "sft"
    if not (sft_dir / "config.json").is_file():
        supervised_warm_start(cfg, hf_dir, sft_dir, info)
    return str(sft_dir)


def _make_model(cfg: TrainConfig) -> None:
    from megadiv.models.tiny import make_tiny_model

    m = cfg.model
    make_tiny_model(m.hf_dir, cfg.warm_start.make_model, tokenizer=cfg.warm_start.tokenizer,
                    chars=cfg.warm_start.tokenizer_chars,
                    layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                    kv_heads=m.num_query_groups or m.num_attention_heads, ffn=m.ffn_hidden_size,
                    tied=True, max_positions=m.max_position_embeddings, seed=cfg.run.seed)
    print(f"made a random {cfg.warm_start.make_model} model at {m.hf_dir}", flush=True)


def supervised_warm_start(cfg: TrainConfig, hf_dir: str, out: Path, info: ParallelInfo) -> None:
    """``warm_start.sft_steps`` steps of token-mean NLL on the training set's reference answers
    (prompt as the template renders it, then the answer and EOS), then export to ``out``."""
    from transformers import AutoTokenizer

    ws = cfg.warm_start
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    dataset = load_dataset(cfg.data)
    template = PromptTemplate.resolve(cfg.data, dataset, tokenizer)
    sampler = PromptSampler(len(dataset), ws.sft_batch_size, rank=info.dp_rank, world=info.dp_size,
                            seed=cfg.data.seed + 1)
    policy = make_policy(cfg, ModelConfig(hf_dir=hf_dir, backend=cfg.model.backend, params_dtype=cfg.model.params_dtype,
                                          transformer_impl=cfg.model.transformer_impl),
                         "actor", OptimConfig(lr=ws.sft_lr, clip_grad=cfg.optim.clip_grad), total_steps=ws.sft_steps)
    eos = tokenizer.eos_token_id
    rows = ws.sft_batch_size // info.dp_size
    micro = _largest_divisor_at_most(rows, cfg.grpo.micro_batch_size * 4)
    with Progress("warm start", total=ws.sft_steps, unit="step") as bar:
        for step in range(1, ws.sft_steps + 1):
            records = [dataset[i] for i in sampler.next_batch()]
            batch = SequenceBatch.pack(
                [template.token_ids(r, tokenizer) for r in records],
                [tokenizer(str(r.answer), add_special_tokens=False)["input_ids"] + [eos] for r in records], pad_id=eos)
            metrics = policy.train_step(batch, sft_objective, micro)
            if not math.isfinite(metrics["loss/nll"]):
                raise NonFiniteError(f"warm start step {step}: the supervised loss is {metrics['loss/nll']} (model "
                                     f"{hf_dir}, warm_start.sft_lr={ws.sft_lr}); check the weights and the learning "
                                     f"rate")
            bar.update()
            if info.rank == 0 and (step % 25 == 0 or step in (1, ws.sft_steps)):
                bar.write(f"warm start {step}/{ws.sft_steps} | nll {metrics['loss/nll']:.4f}")
    policy.save_hf(out, hf_dir)


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, min(n, k) + 1) if n % d == 0)
