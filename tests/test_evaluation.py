"""``megadiv eval`` end to end on tiny random models (accuracy near 0 is expected: the point is
that every stage runs: prompts, the engine, the math and code rewards, the table and the JSON)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megadiv.cli import main
from megadiv.cli.eval import add_arguments, format_table, plan
from megadiv.config import load_config, to_dict
from megadiv.models.tiny import make_tiny_model
from megadiv.trainer.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", tokenizer="bpe", hidden=32, heads=2,
                           kv_heads=1, ffn=64, layers=1, max_positions=2048)


def test_eval_on_gsm8k_and_mbpp_end_to_end(bpe_model, tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["eval", "--model", str(bpe_model), "--data", "gsm8k,mbpp:gbmpo_validation", "--limit", "2",
                 "--max-new-tokens", "8", "--samples", "2", "--temperature", "1.0", "--top-p", "0.9",
                 "--engine", "embedded", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engine"] == "embedded" and report["max_new_tokens"] == 8 and report["top_p"] == 0.9
    assert set(report["results"]) == {"gsm8k:test", "mbpp:gbmpo_validation"}
    for r in report["results"].values():
        assert r["n"] == 2 and set(r) == {"n", "pass@1", "avg@2", "pass@2"}
        assert 0 <= r["avg@2"] <= r["pass@2"] <= 1 and 0 <= r["pass@1"] <= 1
    printed = capsys.readouterr().out
    assert "gsm8k:test" in printed and "mbpp:gbmpo_validation" in printed and f"results: {out}" in printed


def test_eval_of_a_run_takes_the_runs_prompt_engine_and_reward(tmp_path, capsys):
    """A run directory (config.yaml + hf/): the tiny demo's raw template, 4 new tokens, exact match."""
    run = tmp_path / "run"
    make_tiny_model(run / "hf", "qwen2", tokenizer="char", chars="0123456789+=", hidden=32, heads=4, kv_heads=2,
                    ffn=64, layers=1, max_positions=64)
    cfg = load_config(TrainConfig, REPO / "examples" / "tiny" / "grpo.yaml", [f"model.hf_dir={run}/hf", "warm_start.make_model=none",
                                                               "warm_start.sft_steps=0"])
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    assert main(["eval", "--model", str(run / "hf"), "--data", "arithmetic", "--limit", "20"]) == 0
    report = json.loads((run / "eval.json").read_text())
    assert report["max_new_tokens"] == 4 and report["results"]["arithmetic:test"]["n"] == 20
    assert "arithmetic:test  20" in capsys.readouterr().out

    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run_cfg = yaml.safe_load((run / "config.yaml").read_text())
    data, rewards = plan(parser.parse_args(["--model", str(run), "--data", "arithmetic:train,gsm8k"]), run_cfg)
    assert [d.template for d in data] == ["raw", "raw"] and data[0].split == "train" and not data[0].shuffle
    assert [r.name for r in rewards] == ["exact_match", "math"]  # the run's own reward, then GSM8K's
    data, _ = plan(parser.parse_args(["--model", "x", "--data", "gsm8k", "--template", "plain",
                                      "--prompt-style", "gbmpo_eval", "--enable-thinking", "false"]), None)
    assert (data[0].template, data[0].prompt_style, data[0].enable_thinking) == ("plain", "gbmpo_eval", False)
    for bad, why in (("nope", "unknown dataset"), ("gsm8k:dev", "no split 'dev'")):
        with pytest.raises(ValueError, match=why):
            plan(parser.parse_args(["--model", "x", "--data", bad]), None)


def test_eval_refuses_what_is_not_a_model(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path), "--data", "gsm8k"]) == 2
    assert "neither a Hugging Face checkpoint" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("run: {}\n")
    assert main(["eval", "--model", str(tmp_path), "--data", "gsm8k"]) == 2
    assert "has no hf/ export" in capsys.readouterr().err


def test_format_table():
    text = format_table({"a:test": {"n": 3, "pass@1": 0.5, "avg@2": 0.25, "pass@2": 1.0}, "b:test": {"n": 1, "pass@1": 0.0}})
    assert text.splitlines()[0].split() == ["split", "n", "pass@1", "avg@2", "pass@2"]
    assert text.splitlines()[2].split() == ["b:test", "1", "0.000", "-", "-"]
