"""``megadiv make-tiny-model`` and tools/make_tiny_model.py (the same parser): each writes a checkpoint
that transformers loads, and refuses an existing directory in one line with exit code 2. The other verbs are tested with their library (test_config, test_models_dist, test_smollm2,
test_es, test_evaluation, test_divergence_cli, test_plan)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megadiv.cli import main

REPO = Path(__file__).resolve().parent.parent
TINY = ["--family", "llama", "--layers", "1", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--ffn", "32",
        "--tokenizer", "char", "--chars", "0123456789+="]


def test_make_tiny_model_verb_writes_a_loadable_checkpoint(tmp_path, capsys):
    from transformers import AutoConfig, AutoTokenizer

    assert main(["make-tiny-model", *TINY, "--out", str(tmp_path / "m"), "--no-tied"]) == 0
    assert f"wrote llama model to {tmp_path / 'm'}" in capsys.readouterr().out
    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 1, 16)
    assert config.tie_word_embeddings is False
    assert AutoTokenizer.from_pretrained(tmp_path / "m").decode([4]) == "0"  # 4 special tokens, then the chars


def test_the_tool_script_runs_the_same_parser(tmp_path):
    out = tmp_path / "tool"
    proc = subprocess.run([sys.executable, "tools/make_tiny_model.py", *TINY, "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    again = subprocess.run([sys.executable, "tools/make_tiny_model.py", *TINY, "--out", str(out)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    assert again.stderr.strip() == f"megadiv make-tiny-model: error: {out} exists; choose a new directory"
