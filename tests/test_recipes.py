"""Every published recipe composition parses and validates (keys, types, combinations)."""
import itertools
import json
import os
import re
import subprocess
import sys
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
    ds = load_config(TrainConfig, [EXAMPLES / "tiny" / "grpo.yaml", EXAMPLES / "tiny" / "deepspeed.yaml"])
    assert ds.model.backend == "deepspeed" and ds.deepspeed.zero_stage == 3 and ds.parallel.tensor_parallel == 1
    assert (ds.loss, ds.grpo, ds.warm_start) == (base.loss, base.grpo, base.warm_start)


# not the 32B and mixture-of-experts recipes: their layouts are megatron's (sequence parallelism,
# experts over EP ranks, activation recompute), which the DeepSpeed backend refuses by name
@pytest.mark.parametrize("model", [m for m in MODELS if "32b" not in m.stem and "expert_parallel" not in m.read_text()],
                         ids=lambda p: p.stem)
def test_gsm8k_recipes_compose_with_the_deepspeed_backend(model):
    cfg = load_config(TrainConfig, [EXAMPLES / "gsm8k" / "task.yaml", model, ALGORITHMS[0],
                                    EXAMPLES / "gsm8k" / "backends" / "deepspeed.yaml"],
                      [f"model.hf_dir={shipped_config_dir(model)}"])
    assert cfg.model.backend == "deepspeed" and cfg.deepspeed.zero_stage == 3 and cfg.model.params_dtype == "bfloat16"


ATR = EXAMPLES / "atr_grpo"
QWEN3 = [EXAMPLES / "gsm8k" / "models" / f"{m}.yaml" for m in ("qwen3-1.7b", "qwen3-8b")]
ATR_ALGORITHMS = {"grpo": EXAMPLES / "gsm8k" / "algorithms" / "grpo.yaml",
                  "dapo": EXAMPLES / "gsm8k" / "algorithms" / "dapo.yaml", "atr": ATR / "atr_grpo.yaml"}


@pytest.mark.parametrize("model", QWEN3, ids=lambda p: p.stem)
def test_atr_grpo_recipes_validate(model):
    cfgs = {name: load_config(TrainConfig, [ATR / "task.yaml", model, algo],
                              [f"model.hf_dir={shipped_config_dir(model)}"])
            for name, algo in ATR_ALGORITHMS.items()}
    for cfg in cfgs.values():  # evaluated as the paper does, thinking off everywhere (set explicitly)
        assert (cfg.eval.data.name, [d.name for d in cfg.eval.extra_data]) == ("math500", ["aime24", "aime25"])
        assert all(d.enable_thinking is False for d in (cfg.data, cfg.eval.data, *cfg.eval.extra_data))
    atr = cfgs["atr"].loss
    assert atr.policy_loss == "divergence_clip" and atr.measure == "k3" and atr.delta_high is None  # one delta
    assert cfgs["dapo"].loss.eps_high == 0.28 and cfgs["grpo"].loss.policy_loss == "clip"


def test_kl3_recipe_deltas_are_dapos_interval_exactly():
    from megadiv.divergence import ratio_bounds

    loss = load_config(TrainConfig, [EXAMPLES / "tiny" / "grpo.yaml", EXAMPLES / "gsm8k" / "algorithms" / "kl3.yaml"]).loss
    assert ratio_bounds("k3", loss.delta)[0] == pytest.approx(0.8, abs=1e-5)
    assert ratio_bounds("k3", loss.delta_high)[1] == pytest.approx(1.28, abs=1e-5)


GBMPO = EXAMPLES / "gbmpo"


@pytest.mark.parametrize("task", ["gsm8k", "mbpp"])
def test_gbmpo_recipes_validate_with_the_authors_values(task):
    hf_dir = f"model.hf_dir={shipped_config_dir(GBMPO / f'{task}.yaml')}"
    dr = load_config(TrainConfig, GBMPO / f"{task}.yaml", [hf_dir])
    l2 = load_config(TrainConfig, [GBMPO / f"{task}.yaml", GBMPO / "prob_l2.yaml"], [hf_dir])
    assert dr.advantage.estimator == "dr_grpo" and dr.loss.kl_coef == 0 and dr.loss.regularizer is None
    assert dr.loss.loss_agg == "seq-mean-token-sum-norm" and dr.loss.loss_norm_len == dr.rollout.max_new_tokens == 256
    assert (l2.loss.regularizer, l2.loss.regularizer_coef) == ("sampled_prob_l2", 1e-4)
    assert dr.data.prompt_style == "gbmpo_train" and dr.eval.data.prompt_style == "gbmpo_eval"
    assert dr.data.enable_thinking is False and dr.eval.data.enable_thinking is False
    if task == "gsm8k":
        assert dr.reward.name == "last_number" and dr.grpo.mask_truncated and dr.rollout.n_samples == 4
        assert (dr.optim.lr, dr.rollout.temperature, dr.rollout.top_p) == (3e-5, 0.6, 0.95)
    else:
        assert dr.reward.name == "code_shaped" and dr.eval.data.split == "test" and dr.rollout.n_samples == 32
        assert (dr.optim.lr, dr.rollout.temperature, dr.rollout.top_p) == (1e-5, 0.8, 0.9)


def test_enable_thinking_is_checked_against_the_checkpoints_template(tmp_path):
    from megadiv.config import ConfigError

    checkpoint = shipped_config_dir(QWEN3[0])  # a config.json and no chat template
    args = [f"model.hf_dir={checkpoint}", "data.enable_thinking=true"]
    with pytest.raises(ConfigError, match="has no thinking mode"):
        load_config(TrainConfig, [EXAMPLES / "gsm8k" / "task.yaml", QWEN3[0], ATR_ALGORITHMS["grpo"]], args)
    qwen3 = tmp_path / "qwen3"
    qwen3.mkdir()
    (qwen3 / "config.json").write_text((checkpoint / "config.json").read_text())
    (qwen3 / "chat_template.jinja").write_text("{% if enable_thinking is defined and not enable_thinking %}{% endif %}")
    cfg = load_config(TrainConfig, [EXAMPLES / "gsm8k" / "task.yaml", QWEN3[0], ATR_ALGORITHMS["grpo"]],
                      [f"model.hf_dir={qwen3}", "data.enable_thinking=true"])
    assert cfg.data.enable_thinking is True


# check-config in a trainer Python that cannot import sglang (the container keeps it in /opt/sglang):
# every recipe in one process, each at the world size its header's torchrun line names (8: one node).
_CHECK_WITHOUT_SGLANG = """
import json, sys
sys.modules["sglang"] = None                  # any sglang import raises ImportError
from megadiv.cli import main
for args in json.loads(sys.argv[1]):
    print("RC", main(["check-config", *args]), file=sys.stderr, flush=True)
"""


def recipe_world_size(model_file: Path) -> int:
    """Nodes x GPUs of the recipe's ``torchrun --nnodes N --nproc_per_node G`` line (one node of 8 without one)."""
    found = re.search(r"--nnodes (\d+) --nproc_per_node (\d+)", model_file.read_text())
    return int(found.group(1)) * int(found.group(2)) if found else 8


def test_every_recipe_passes_check_config_without_sglang_in_the_trainer(tmp_path):
    """A colocated recipe used to resolve sync_method auto to 'tensor' and crash at its first push
    in the container (sglang only in the servers' Python): check-config now passes each recipe
    there and prints the sync method, which needs no sglang on the trainer's side."""
    server_python = tmp_path / "sglang-python"        # the servers' own environment, which has sglang
    server_python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    server_python.chmod(0o755)
    launched = {m: "server_urls" not in m.read_text() for m in MODELS}
    runs = [[str(EXAMPLES / "gsm8k" / "task.yaml"), str(m), str(EXAMPLES / "gsm8k" / "algorithms" / "grpo.yaml"),
             f"run.output_dir={tmp_path}", "--world-size", str(recipe_world_size(m))]
            + ([f"rollout.server_python={server_python}"] if launched[m] else []) for m in MODELS]
    # the other GPU recipes (ATR-GRPO on the Qwen3-1.7B recipe, GBMPO) and the CPU ones with a server
    others = [[str(EXAMPLES / "gsm8k" / "task.yaml"), str(EXAMPLES / "gsm8k" / "models" / "qwen3-1.7b.yaml"),
               str(EXAMPLES / "gsm8k" / "algorithms" / "grpo.yaml"), str(EXAMPLES / "atr_grpo" / "task.yaml"),
               str(EXAMPLES / "atr_grpo" / "atr_grpo.yaml"), "model.hf_dir=/checkpoints/Qwen3-1.7B", "--world-size", "8",
               # the training set is the user's; MATH-500's file has the same fields
               f"data.path={EXAMPLES.parent / 'megadiv' / 'data' / 'files' / 'math500' / 'test.jsonl'}"],
              [str(EXAMPLES / "gbmpo" / "gsm8k.yaml"), "--world-size", "8"],
              [str(EXAMPLES / "gbmpo" / "mbpp.yaml"), "--world-size", "8"],
              [str(EXAMPLES / "smollm2" / "grpo.yaml"), "--hf-config",
               str(EXAMPLES / "hf_configs" / "SmolLM2-135M-Instruct" / "config.json"), "--world-size", "2"],
              [str(EXAMPLES / "tiny" / "grpo.yaml"), str(EXAMPLES / "tiny" / "sglang.yaml"), "--world-size", "2"]]
    runs += [args + [f"run.output_dir={tmp_path}", f"rollout.server_python={server_python}"] for args in others]
    proc = subprocess.run([sys.executable, "-c", _CHECK_WITHOUT_SGLANG, json.dumps(runs)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = proc.stderr.split("RC ")[:-1]
    codes = [int(line.split()[0]) for line in proc.stderr.split("RC ")[1:]]
    assert codes == [0] * len(runs), proc.stderr[-3000:]
    auto = "rollout.sync_method: auto -> tensor for servers launched on GPUs the trainer's ranks hold"
    for model, report in zip(MODELS, reports):
        assert (auto if launched[model] else "rollout.sync_method: distributed") in report, (model.name, report)
    assert sum(auto in r for r in reports[:len(MODELS)]) == 6        # all but the 235B one launch their servers
    assert all(auto in r for r in reports[len(MODELS):-2])           # ATR-GRPO, GBMPO
    # the CPU recipes broadcast over gloo (on a GPU machine their servers would need GPUs of their own)
    assert all("rollout.sync_method: distributed (the launched servers need GPUs of their own" in r
               for r in reports[-2:])


@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.stem)
def test_gsm8k_recipes_ship_the_planners_checkpoint_interval(capsys, model):
    """checkpoint.every in each model recipe is `megadiv plan`'s recommendation for DAPO at the
    recipe's node count (its torchrun line's --nnodes; one node without one)."""
    from megadiv.cli import main
    text = model.read_text()
    nodes = re.search(r"--nnodes (\d+)", text)
    rc = main(["plan", str(EXAMPLES / "gsm8k" / "task.yaml"), str(model), str(EXAMPLES / "gsm8k" / "algorithms" / "dapo.yaml"),
               "--hf-config", str(shipped_config_dir(model) / "config.json"), "--nodes", nodes[1] if nodes else "1",
               "--gpus-per-node", "8", "--gpu-memory-gib", "80", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert yaml.safe_load(text)["checkpoint"]["every"] == json.loads(out.out)["checkpoint_interval"]["every"]
