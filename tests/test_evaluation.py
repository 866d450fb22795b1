"""``megadiv eval`` end to end on tiny random models (accuracy near 0 is expected: the point is
that every stage runs: prompts, the engine, the math and code rewards, the table and the JSON)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from megadiv.cli import main
from megadiv.cli.eval import add_arguments, format_lengths, format_table, plan
from megadiv.config import load_config, to_dict
from megadiv.evaluation import EvalSuite, response_tokens
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
    assert report["engine"] == "embedded" and report["top_p"] == 0.9
    assert set(report["results"]) == {"gsm8k:test", "mbpp:gbmpo_validation"}
    for r in report["results"].values():
        assert set(r) == {"n", "pass@1", "avg@2", "pass@2", "max_new_tokens", "response_tokens"}
        assert r["n"] == 2 and r["max_new_tokens"] == 8
        assert 0 <= r["avg@2"] <= r["pass@2"] <= 1 and 0 <= r["pass@1"] <= 1
        for kind, count, rate in (("greedy", 2, r["pass@1"]), ("samples@2", 4, r["avg@2"])):
            stats = r["response_tokens"][kind]
            assert stats["all"]["n"] == count and stats["correct"]["n"] == round(rate * count)
            assert stats["correct"]["n"] + stats["incorrect"]["n"] == count and 1 <= stats["all"]["median"] <= 8
    printed = capsys.readouterr().out
    assert "gsm8k:test" in printed and "mbpp:gbmpo_validation" in printed and f"results: {out}" in printed
    assert "mbpp:gbmpo_validation samples@2  4" in printed  # the length table


def test_eval_of_a_run_takes_the_runs_prompt_engine_and_reward(tmp_path, capsys):
    """A run directory (config.yaml + hf/): the tiny demo's raw template, 4 new tokens, exact match."""
    run = tmp_path / "run"
    make_tiny_model(run / "hf", "qwen2", tokenizer="char", chars="0123456789+=", hidden=32, heads=4, kv_heads=2,
                    ffn=64, layers=1, max_positions=64)
    cfg = load_config(TrainConfig, REPO / "examples" / "tiny" / "grpo.yaml", [f"model.hf_dir={run}/hf", "warm_start.make_model=none",
                                                               "warm_start.sft_steps=0"])
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    assert main(["eval", "--model", str(run / "hf"), "--data", "arithmetic", "--limit", "20"]) == 0
    result = json.loads((run / "eval.json").read_text())["results"]["arithmetic:test"]
    assert result["max_new_tokens"] == 4 and result["n"] == 20  # the run's length
    assert "arithmetic:test  20" in capsys.readouterr().out
    # every registered benchmark on the demo's 12-character tokenizer: the run's raw template goes to
    # arithmetic alone; the others get the chat prompt (raw, MBPP's text through this tokenizer was empty)
    benchmarks = "gsm8k,math500,aime24,aime25,mbpp"
    assert main(["eval", "--model", str(run / "hf"), "--data", benchmarks, "--limit", "2", "--max-new-tokens", "2"]) == 0
    results = json.loads((run / "eval.json").read_text())["results"]
    assert {name: (r["n"], r["max_new_tokens"], r.get("error")) for name, r in results.items()} == {
        f"{name}:test": (2, 2, None) for name in benchmarks.split(",")}

    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run_cfg = yaml.safe_load((run / "config.yaml").read_text())
    data, rewards, max_new = plan(parser.parse_args(["--model", str(run), "--data", "arithmetic:train,gsm8k"]),
                                  run_cfg)
    assert [d.template for d in data] == ["raw", "auto"] and data[0].split == "train" and not data[0].shuffle
    assert [r.name for r in rewards] == ["exact_match", "math"]  # the run's own reward, then GSM8K's
    assert max_new == [4, None]  # the run's length for its own data set; GSM8K's own default
    from transformers import AutoTokenizer

    data, rewards, max_new = plan(parser.parse_args(["--model", str(run), "--data", "arithmetic," + benchmarks]),
                                  run_cfg)
    suite = EvalSuite.build(data, rewards, AutoTokenizer.from_pretrained(run / "hf"), max_new_tokens=max_new)
    suite.close()
    assert [s.max_new_tokens for s in suite.sets] == [4, 512, 2048, 4096, 4096, 512]  # the registry's defaults
    data, _, _ = plan(parser.parse_args(["--model", "x", "--data", "gsm8k", "--template", "plain",
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
    (tmp_path / "config.yaml").unlink()
    (tmp_path / "config.json").write_text("{}")
    assert main(["eval", "--model", str(tmp_path), "--data", "gsm8k", "--max-new-tokens", "0"]) == 2
    assert "need --max-new-tokens >= 1 and --samples >= 0, got 0 and 0" in capsys.readouterr().err


def test_a_broken_split_keeps_the_others_and_shows_progress(tmp_path, capsys):
    """The demo's 12-character tokenizer and a raw template: MBPP's prompts lose their letters, and
    some are left empty; that split reports it, arithmetic is still evaluated, printed and written,
    and each split's progress is printed as lines (capsys is no terminal)."""
    hf = make_tiny_model(tmp_path / "hf", "qwen2", tokenizer="char", chars="0123456789+=", hidden=32, heads=4,
                         kv_heads=2, ffn=64, layers=1, max_positions=64)
    out = tmp_path / "e.json"
    args = ["eval", "--model", str(hf), "--template", "raw", "--limit", "12", "--max-new-tokens", "4",
            "--engine", "embedded", "--out", str(out)]
    assert main([*args, "--data", "arithmetic,mbpp"]) == 0
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["arithmetic:test", "mbpp:test"]
    assert results["arithmetic:test"]["n"] == 12 and 0 <= results["arithmetic:test"]["pass@1"] <= 1
    assert results["mbpp:test"]["n"] is None and results["mbpp:test"]["error"].startswith("ValueError: ")
    assert "render to an empty prompt with the raw template (first: " in results["mbpp:test"]["error"]
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    # 12 problems go to the engine 8 at a time: the first line after 8, the last one at the end
    assert any(line.startswith("evaluating arithmetic:test: 8/12 response (67%) | ") and " | eta " in line
               for line in lines)
    assert any(line.startswith("evaluating arithmetic:test: 12/12 response (100%) | ") and line.endswith(" | done")
               for line in lines)
    assert any(line.startswith("mbpp:test") and "error: ValueError: " in line for line in lines)
    assert "megadiv eval: 1 of 2 splits failed: mbpp:test" in captured.err
    # every split failed: exit status 1, the report still written
    assert main([*args, "--data", "mbpp"]) == 1
    assert "error" in json.loads(out.read_text())["results"]["mbpp:test"]


def test_response_token_statistics_by_hand():
    lengths, correct = torch.tensor([3, 5, 10, 2, 7]), torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    assert response_tokens(lengths, correct) == {
        "all": {"n": 5, "mean": 27 / 5, "median": 5.0},            # sorted 2 3 5 7 10
        "correct": {"n": 3, "mean": 20 / 3, "median": 7.0},        # 3 7 10
        "incorrect": {"n": 2, "mean": 3.5, "median": 3.5}}         # 2 5: the mean of the two middle values
    none_right = response_tokens(torch.tensor([4, 6]), torch.zeros(2))
    assert none_right["correct"] == {"n": 0, "mean": None, "median": None} and none_right["all"]["median"] == 5.0


def test_response_tokens_in_the_json_are_the_engines(bpe_model, tmp_path):
    """The JSON's greedy length statistics equal those of the same engine's greedy responses, taken
    here directly (6 problems: one engine call either way)."""
    from transformers import AutoTokenizer

    from megadiv.data import DataConfig, PromptTemplate, load_dataset
    from megadiv.rollout import RolloutConfig, SamplingParams, make_engine

    out = tmp_path / "e.json"
    assert main(["eval", "--model", str(bpe_model), "--data", "gsm8k", "--limit", "6", "--max-new-tokens", "12",
                 "--engine", "embedded", "--out", str(out)]) == 0
    stats = json.loads(out.read_text())["results"]["gsm8k:test"]["response_tokens"]["greedy"]["all"]
    tokenizer = AutoTokenizer.from_pretrained(bpe_model)
    cfg = DataConfig(name="gsm8k", split="test", max_items=6)
    dataset = load_dataset(cfg)
    template = PromptTemplate.resolve(cfg, dataset, tokenizer)
    engine = make_engine(RolloutConfig(engine="embedded"), str(bpe_model))
    try:
        groups = engine.generate([template.token_ids(r, tokenizer) for r in dataset],
                                 SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    finally:
        engine.shutdown()
    lengths = sorted(len(g[0].token_ids) for g in groups)
    assert stats == {"n": 6, "mean": pytest.approx(sum(lengths) / 6, abs=1e-12),
                     "median": (lengths[2] + lengths[3]) / 2}


def test_format_table():
    text = format_table({"a:test": {"n": 3, "pass@1": 0.5, "avg@2": 0.25, "pass@2": 1.0}, "b:test": {"n": 1, "pass@1": 0.0},
                         "c:test": {"n": None, "error": "ValueError: no such file"}})
    assert text.splitlines()[0].split() == ["split", "n", "pass@1", "avg@2", "pass@2"]
    assert text.splitlines()[2].split() == ["b:test", "1", "0.000", "-", "-"]
    assert text.splitlines()[3].split() == ["c:test", "-", "error:", "ValueError:", "no", "such", "file"]
    assert text.splitlines()[0].index("avg@2") == text.splitlines()[1].index("0.250")  # the error runs on
    stats = {"all": {"n": 2, "mean": 3.0, "median": 3.0}, "correct": {"n": 0, "mean": None, "median": None},
             "incorrect": {"n": 2, "mean": 3.0, "median": 3.0}}
    lengths = format_lengths({"a:test": {"n": 2, "response_tokens": {"greedy": stats}}, "c:test": {"error": "x"}})
    assert lengths.splitlines()[1].split() == ["a:test", "greedy", "2", "3.0", "3.0", "0", "-", "-", "2", "3.0", "3.0"]
