"""Drivers that run many trainings: each candidate is an ordinary ``megadiv train`` run.

- runner.py: one run's command line, running it here (one or K at a time) or as a SLURM job array,
  reading its summary.json
- es.py: evolution-strategies search of GBMPO's mirror map (``megadiv es``)
- sweep.py: a grid of configs x seeds with a significance-tested table (``megadiv sweep``)
- significance.py: per-cell mean, interval and the paired-by-seed test of a sweep

They sit above the loop (megadiv.trainer) and add no branch inside it; their verbs are in megadiv.cli.
"""
