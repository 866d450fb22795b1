# The two things a newcomer runs. Both build the CPU-tier environment first (idempotent).
.PHONY: setup demo test

setup:
	bash tools/setup_env.sh

# The main job: the tiny GRPO demo on CPU (2 ranks, TP=2, KL3 clipping, embedded engine), ~10 minutes.
# It prints the run directory and the held-out accuracy before -> after (summary.json).
demo: setup
	.venv/bin/megadiv bounds --table
	.venv/bin/megadiv train examples/tiny/grpo.yaml --nproc 2

# The full test suite (CPU; GPU tests are skipped without CUDA).
test: setup
	.venv/bin/python -m pytest
