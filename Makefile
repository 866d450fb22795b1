# What a newcomer runs. Each builds the CPU-tier environment first (idempotent).
.PHONY: setup demo test test-all lint

setup:
	bash tools/setup_env.sh

# The main job: the tiny GRPO demo on CPU (2 ranks, TP=2, KL3 clipping, embedded engine), ~10 minutes.
# It prints the run directory and the held-out accuracy before -> after (summary.json).
demo: setup
	.venv/bin/megadiv bounds --table
	.venv/bin/megadiv train examples/tiny/grpo.yaml --nproc 2

# The fast tier, before every commit: every test not marked slow (README, Tests).
test: setup
	.venv/bin/python -m pytest -m "not slow"

# What CI runs (.ci/run): the linter, then every test (GPU tests skip without CUDA).
test-all: lint
	.venv/bin/python -m pytest

# pyflakes, import order and bugbear (ruff.toml); zero findings.
lint: setup
	.venv/bin/ruff check .
