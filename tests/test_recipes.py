"""Every published recipe composition parses and validates (keys, types, combinations)."""
import itertools
import json
from pathlib import Path

import pytest

from megadiv.config import load_config
from megadiv.trainer.config import TrainConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = sorted((EXAMPLES / "gsm8k" / "models").glob("*.yaml"))
ALGORITHMS = sorted((EXAMPLES / "gsm8k" / "algorithms").glob("*.yaml"))


@pytest.fixture(scope="module")
def checkpoint_stub(tmp_path_factory):
    """A config.json with Qwen3-8B's head counts, standing in for the real checkpoints."""
    d = tmp_path_factory.mktemp("qwen3-8b")
    (d / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8,
                                               "num_hidden_layers": 36}))
    return d


@pytest.mark.parametrize("model,algorithm", list(itertools.product(MODELS, ALGORITHMS)),
                         ids=lambda p: p.stem)
def test_gsm8k_recipes_validate(model, algorithm, checkpoint_stub):
    cfg = load_config(TrainConfig, [EXAMPLES / "gsm8k" / "task.yaml", model, algorithm],
                      [f"model.hf_dir={checkpoint_stub}"])
    assert cfg.data.name == "gsm8k" and cfg.reward.name == "math" and cfg.rollout.engine == "sglang"
    assert cfg.advantage.group_size == cfg.rollout.n_samples


def test_recipe_algorithms_mean_what_they_say(checkpoint_stub):
    def algo(name):
        return load_config(TrainConfig, [EXAMPLES / "gsm8k" / "task.yaml", MODELS[0],
                                         EXAMPLES / "gsm8k" / "algorithms" / f"{name}.yaml"],
                           [f"model.hf_dir={checkpoint_stub}"])
    assert algo("dapo").loss.eps_high == 0.28 and algo("dapo").grpo.dynamic_sampling
    assert algo("kl3").loss.policy_loss == "divergence_clip" and algo("kl3").loss.measure == "k3"
    assert algo("dr_grpo").advantage.estimator == "dr_grpo" and algo("grpo").loss.kl_coef == 0.04
    assert algo("prob_l2").loss.regularizer == "sampled_prob_l2"


def test_tiny_demo_configs_validate(tmp_path):
    base = load_config(TrainConfig, EXAMPLES / "tiny" / "grpo.yaml")
    assert base.parallel.tensor_parallel == 2 and base.rollout.engine == "embedded"
    assert base.loss.measure == "k3" and base.warm_start.make_model == "qwen2"
    sglang = load_config(TrainConfig, [EXAMPLES / "tiny" / "grpo.yaml", EXAMPLES / "tiny" / "sglang.yaml"])
    assert sglang.rollout.engine == "sglang" and sglang.loss == base.loss
