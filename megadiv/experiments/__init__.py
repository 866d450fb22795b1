"""Drivers that run many trainings: each candidate is an ordinary ``megadiv train`` run.

- runner.py: one run's command line, running it here or as a SLURM job array, reading its summary.json
- es.py: evolution-strategies search of GBMPO's mirror map (``megadiv es``)

They sit above the loop (megadiv.trainer) and add no branch inside it; their verbs are in megadiv.cli.
"""
