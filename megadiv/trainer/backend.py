"""The backend seam: the one place that knows which policy class a run uses.

``model.backend: megatron`` builds megatron-core chunks (megadiv.policy.megatron.Policy: TP/PP/DP,
the families megadiv maps); ``model.backend: deepspeed`` a Hugging Face model in a DeepSpeed ZeRO
engine (megadiv.policy.deepspeed.DeepSpeedPolicy: data parallelism, any causal LM). Both offer what
the loop, the warm start and checkpoint.py call: ``log_probs``, ``train_step``, ``logits_for``,
``export_buckets`` (and ``exports_per_replica``: whether it is collective over one DP replica only), ``optimizer_state_bytes``, ``save_hf``, ``vocab_size``, ``device``, and the
``backend`` name that selects the checkpoint format.

It lives here, not in megadiv.policy: it reads the whole run config (``TrainConfig``: parallel,
deepspeed and grpo sections), and megadiv.policy must not import megadiv.trainer.
"""
from __future__ import annotations

from megadiv.config import ModelConfig, OptimConfig
from megadiv.policy.megatron import Policy
from megadiv.trainer.config import TrainConfig


def make_policy(cfg: TrainConfig, model: ModelConfig, role: str = "actor", optim: OptimConfig | None = None,
                total_steps: int = 1, log_probs_chunk: int | None = None, temperature: float = 1.0):
    """The ``role`` ('actor' or 'reference') policy of ``model`` on this rank's backend
    (``model.backend``), parallelised by ``cfg.parallel`` or ``cfg.deepspeed``."""
    if model.backend == "deepspeed":
        from megadiv.policy.deepspeed import DeepSpeedPolicy

        return DeepSpeedPolicy(model, cfg.deepspeed, role, optim, total_steps, log_probs_chunk, temperature)
    return Policy(model, cfg.parallel, role, optim, total_steps, log_probs_chunk, temperature,
                  max_tokens_per_micro_batch=cfg.grpo.max_tokens_per_micro_batch,
                  pack_sequences=cfg.grpo.pack_sequences,
                  routing_replay=role == "actor" and cfg.grpo.routing_replay != "none")
