"""The GRPO loop and what only the loop uses.

- config.py: ``TrainConfig``, the whole run config (every section, cross-section checks)
- grpo.py: ``train(cfg)``, the loop as phases: generate -> reward -> advantage -> train -> sync -> eval/save
- driver.py: the job's rollout driver (engine stream, sampler, rewards, evaluation; its own process
  with SGLang, ``DriverProcess``; the batch ahead under ``grpo.overlap``)
- handoff.py: each data-parallel replica's rows, packed, through the driver's store (no collective
  open while the ranks wait)
- rollout.py: ``Rollout``, the rollout as one rank sees it (collect, push_weights, evaluate)
- experience.py: completions and rewards -> advantages and the rows a policy trains on
- backend.py: ``make_policy``, the one place that picks the policy class (megadiv.policy)
- checkpoint.py, warm_start.py, metrics.py, lifecycle.py: checkpoints and resume, the warm start,
  metrics and loggers, the run lock and stop signals

The verbs that start it are in megadiv.cli; drivers that run many trainings in megadiv.experiments.
"""
