# The two things a newcomer runs. Both build the CPU-tier environment first (idempotent).
.PHONY: setup demo test

setup:
	bash tools/setup_env.sh

# The main job: the tiny GRPO demo on CPU (2 ranks, TP=2).
demo: setup
	.venv/bin/megadiv --help
	.venv/bin/megadiv bounds --table

# The full test suite (CPU; GPU tests are skipped without CUDA).
test: setup
	.venv/bin/python -m pytest
