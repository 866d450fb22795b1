"""Every published recipe composition parses and validates (keys, types, combinations)."""
import itertools
from pathlib import Path

import pytest
import yaml

from megadiv.config import load_config
from megadiv.trainer.config import TrainConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = sorted((EXAMPLES / "gsm8k" / "models").glob("*.yaml"))
ALGORITHMS = sorted((EXAMPLES / "gsm8k" / "algorithms").glob("*.yaml"))


def shipped_config_dir(model_file: Path) -> Path:
    """examples/hf_configs/<name>: the public config.json of the checkpoint the recipe names."""
    return EXAMPLES / "hf_configs" / Path(yaml.safe_load(model_file.read_text())["model"]["hf_dir"]).name


@pytest.mark.parametrize("model,algorithm", list(itertools.product(MODELS, ALGORITHMS)),
                         ids=lambda p: p.stem)
def test_gsm8k_recipes_validate(model, algorithm):
    """Against each recipe's own architecture (head counts, layers: TP and PP must divide them)."""
    cfg = load_config(TrainConfig, [EXAMPLES / "gsm8k" / "task.yaml", model, algorithm],
                      [f"model.hf_dir={shipped_config_dir(model)}"])
    assert cfg.data.name == "gsm8k" and cfg.reward.name == "math" and cfg.rollout.engine == "sglang"
    assert cfg.advantage.group_size == cfg.rollout.n_samples


def test_recipe_algorithms_mean_what_they_say():
    def algo(name):
        return load_config(TrainConfig, [EXAMPLES / "gsm8k" / "task.yaml", MODELS[0],
                                         EXAMPLES / "gsm8k" / "algorithms" / f"{name}.yaml"],
                           [f"model.hf_dir={shipped_config_dir(MODELS[0])}"])
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
