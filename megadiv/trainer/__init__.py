"""The GRPO loop and what only the loop uses.

- config.py: ``TrainConfig``, the whole run config (every section, cross-section checks)
- grpo.py: ``train(cfg)``, the loop as phases: generate -> reward -> advantage -> train -> sync -> eval/save
- driver.py: rank 0's rollout driver (engine, sampler, rewards; the batch ahead under ``grpo.overlap``)
- experience.py: completions and rewards -> advantages and the rows a policy trains on
- backend.py: ``make_policy``, the one place that picks the policy class (megadiv.policy)
- checkpoint.py, warm_start.py, metrics.py, lifecycle.py: checkpoints and resume, the warm start,
  metrics and loggers, the run lock and stop signals

The verbs that start it are in megadiv.cli; drivers that run many trainings in megadiv.experiments.
"""
