"""FP8 on the CPU tier: which recipe runs where (checked before any GPU work) and the sequence
multiple the policy pads to."""
import re
import subprocess
import sys

import pytest

from megadiv.config import ConfigError, ModelConfig, ParallelConfig
from megadiv.models.fp8 import FP8_RECIPES, check_fp8
from megadiv.policy.megatron import sequence_multiple

HOPPER, BLACKWELL, AMPERE, ADA = (9, 0), (10, 0), (8, 0), (8, 9)


@pytest.mark.parametrize("recipe, te, capability, error", [
    ("tensorwise", (2, 2), HOPPER, None),
    ("tensorwise", (2, 1), HOPPER, r"'tensorwise' needs Transformer Engine >= 2.2; 2.1 is installed"),
    ("delayed", (2, 0), ADA, None),
    ("delayed", (2, 0), AMPERE, r"compute capability 8.9 or newer; this GPU has compute capability 8.0$"),
    ("mxfp8", (2, 5), HOPPER, r"'mxfp8' needs a GPU of compute capability 10.0 or newer \(Blackwell\).*"
                              r"9.0; use 'tensorwise' or 'delayed'"),
    ("mxfp8", (2, 5), BLACKWELL, None),
    ("mxfp8", (2, 0), BLACKWELL, r"'mxfp8' needs Transformer Engine >= 2.1"),
    ("blockwise", (2, 3), HOPPER, None),
    ("blockwise", (2, 3), BLACKWELL, r"compute capability 9.0 to below 10.0 \(Hopper\)"),
    ("blockwise", (2, 2), HOPPER, r">= 2.3"),
    ("tensorwise", None, None, None),   # nothing known here: nothing to check
    ("none", (1, 0), AMPERE, None),
])
def test_fp8_recipe_needs_its_te_version_and_gpu_generation(recipe, te, capability, error):
    if error is None:
        check_fp8(recipe, te, capability)
    else:
        with pytest.raises(ConfigError, match=error):
            check_fp8(recipe, te, capability)


def test_every_fp8_choice_of_the_config_has_a_rule():
    import typing
    assert set(typing.get_args(typing.get_type_hints(ModelConfig)["fp8"])) - {"none"} == set(FP8_RECIPES)


def test_setup_py_te_range_runs_every_recipe():
    """setup.py's `gpu` extra bounds TE to megatron-core 0.16.1's declared range (>=2.9, <2.12; the
    lock test checks that against the wheels' metadata): its floor is new enough for every FP8 recipe."""
    text = open("setup.py").read()
    floor = re.search(r'"transformer-engine\[[^\]]*\]>=(\d+)\.(\d+)[^",]*,<2\.12\.0"', text)
    assert floor, "setup.py's gpu extra has no bounded transformer-engine requirement"
    assert (int(floor[1]), int(floor[2])) == (2, 9)
    assert max(min_te for min_te, _, _ in FP8_RECIPES.values()) <= (2, 9)


def test_sequence_multiple_for_fp8_and_sequence_parallelism():
    tp2 = ParallelConfig(tensor_parallel=2)
    assert sequence_multiple(ModelConfig(), ParallelConfig()) == 1
    assert sequence_multiple(ModelConfig(fp8="tensorwise"), tp2) == 32
    assert sequence_multiple(ModelConfig(), ParallelConfig(tensor_parallel=2, sequence_parallel=True)) == 2


def test_check_config_runs_the_fp8_check_here(tmp_path):
    """On this CPU machine (no TE, no GPU) nothing is known and check-config accepts the recipe;
    the builder then refuses FP8 without TE on a GPU (models/builder.py)."""
    out = subprocess.run([sys.executable, "-m", "megadiv.cli", "check-config", "model.fp8=mxfp8",
                          f"model.hf_dir={tmp_path / 'm'}", "warm_start.make_model=qwen2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fp8: mxfp8" in out.stdout


@pytest.mark.parametrize("fp8, budget, tp_only", [("delayed", 4608, True), ("delayed", None, False),
                                                   ("tensorwise", 4608, False), ("none", 4608, False)])
def test_delayed_scaling_with_token_budgets_reduces_amax_over_tp_only(monkeypatch, fp8, budget, tp_only):
    """Delayed scaling all-reduces amax over TP x DP at every micro-batch; token budgets give the DP
    replicas different micro-batch counts, which would hang there: the policy asks megatron for its
    TP-only amax group (tp_only_amax_red) exactly then. The model config megatron is given, read
    where the policy builds the model (no GPU here to build an FP8 one)."""
    from megadiv.policy import megatron

    built = {}

    def build_model(cfg, role, parallel, config_overrides):
        built.update(config_overrides)
        raise StopIteration   # stop before anything needs a GPU

    monkeypatch.setattr(megatron, "build_model", build_model)
    with pytest.raises(StopIteration):
        megatron.Policy(ModelConfig(hf_dir="unused", fp8=fp8, transformer_impl="auto"), ParallelConfig(),
                                max_tokens_per_micro_batch=budget)
    assert built.get("tp_only_amax_red", False) is tp_only
