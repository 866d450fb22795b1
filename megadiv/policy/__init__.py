"""What owns a model on a rank and trains it: the policy behind the loop's one interface.

- megatron.py: ``Policy``, megatron-core chunks under TP/PP/DP: ``log_probs``, ``train_step``,
  ``export_buckets``, checkpoint state (the only code that drives megatron's pipeline schedule)
- deepspeed.py: ``DeepSpeedPolicy``, any Hugging Face causal LM in a DeepSpeed ZeRO engine, the
  same interface; deepspeed_config.py: its config section (``deepspeed:``)
- batches.py: ``SequenceBatch`` (the rows of one step), token-budget micro-batches, THD packing
- objectives.py: the per-micro-batch loss functions in megatron's per-token-loss form

Imports models/ and divergence/, never megadiv.trainer. Which policy a run gets is decided once,
by ``megadiv.trainer.backend.make_policy`` (it reads the whole run config).
"""
