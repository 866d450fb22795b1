"""Config loading: YAML + overrides into frozen dataclasses; every error names its key."""
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megadiv.config import ConfigError, load_config, valid_keys
from megadiv.trainer.config import TrainConfig

# A config that validates without a checkpoint on disk: the tiny model would be created here.
NEW_MODEL = ["model.hf_dir=/nonexistent/megadiv-test-model", "warm_start.make_model=qwen2"]


def load(overrides=(), path=None):
    return load_config(TrainConfig, path, [*NEW_MODEL, *overrides])


@pytest.fixture
def yaml_file(tmp_path):
    def write(text: str):
        path = tmp_path / "cfg.yaml"
        path.write_text(textwrap.dedent(text))
        return path
    return write


def test_defaults_file_and_overrides_compose(yaml_file):
    path = yaml_file("""
        parallel: {tensor_parallel: 2}
        optim:
          lr: 1.0e-5
    """)
    cfg = load(path=path, overrides=["optim.lr=3e-6", "grpo.steps=7", "model.num_query_groups=2"])
    assert cfg.parallel.tensor_parallel == 2 and cfg.parallel.pipeline_parallel == 1
    assert cfg.optim.lr == pytest.approx(3e-6) and cfg.grpo.steps == 7 and cfg.model.num_query_groups == 2
    assert isinstance(cfg, TrainConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0  # frozen


def test_ints_are_accepted_for_floats_but_not_strings():
    assert load(["optim.lr=1"]).optim.lr == 1.0
    assert load(["optim.lr=3e-6"]).optim.lr == 3e-6  # YAML 1.1 reads this as a string
    with pytest.raises(ConfigError, match="optim.lr: expected float"):
        load(["optim.lr=fast"])
    with pytest.raises(ConfigError, match="parallel.tensor_parallel: expected int"):
        load(["parallel.tensor_parallel=true"])


@pytest.mark.parametrize("override,message", [
    ("bogus.key=1", "unknown config key 'bogus.key'"),
    ("parallel.tensor_paralel=2", "did you mean 'parallel.tensor_parallel'"),
    ("optim.learning_rate=1", "unknown config key 'optim.learning_rate'"),
    ("model.fp8=e4m3", "model.fp8: 'e4m3' is not one of"),
    ("noequals", "key.sub=value"),
])
def test_bad_keys_and_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load([override])


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tensor_parallel=3"], "does not divide the 4 attention heads"),
    (["parallel.tensor_parallel=4", "model.num_query_groups=2"], "does not divide the 2 key/value heads"),
    (["parallel.pipeline_parallel=3"], "exceeds the 2 layers"),
    (["parallel.sequence_parallel=true"], "sequence_parallel needs"),
    (["model.hidden_size=66"], "not divisible by model.num_attention_heads"),
    (["optim.min_lr=1.0"], "min_lr <= lr"),
    (["advantage.group_size=4"], "must equal rollout.n_samples"),
    (["grpo.micro_batch_size=7"], "whole grpo.micro_batch_size=7"),
    (["loss.eps_low=1.5"], "loss: eps_low must lie in"),
    (["rollout.top_p=0"], "rollout.top_p must lie in"),
    (["loss.regularizer=full_prob_l2", "loss.regularizer_coef=1e-4", "parallel.pipeline_parallel=2"],
     "supports parallel.pipeline_parallel=1 only"),
    # a full-vocabulary clip measure would need pi_old's logits in the loop: refused with the reason
    *[(["loss.policy_loss=divergence_clip", f"loss.measure={m}"], f"loss.measure={m} is a full-vocabulary measure")
      for m in ("full_kl", "full_prob_l2", "full_mirror")],
    (["loss.mirror_map.seed=3"], "mirror_map is set but neither regularizer nor"),
    (["loss.regularizer=sampled_mirror", "loss.mirror_map.params=/nonexistent.json"], "no file /nonexistent.json"),
    # one step off-policy without importance weights would train on another policy's samples as its own
    (["grpo.overlap=true"], "grpo.overlap trains each batch on weights one step newer.*set loss.tis_cap"),
])
def test_impossible_combinations_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(overrides)


def test_world_size_must_split_into_model_parallel_groups():
    cfg = load(["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"])
    assert cfg.parallel.data_parallel_size(8) == 2
    with pytest.raises(ConfigError, match="world size 6 is not divisible"):
        cfg.parallel.data_parallel_size(6)


# (overrides, world size, what the error must name): each shape splits globally (DP=1) but not per replica
PER_REPLICA = [
    # the case: 24 rows on DP=4 are 6 per replica, which 4 mini-batches cannot split (4 of 6 trained)
    (["grpo.prompts_per_step=3", "rollout.n_samples=8", "advantage.group_size=8", "grpo.mini_batches=4",
      "grpo.micro_batch_size=2", "parallel.tensor_parallel=2"], 8,
     r"each replica's 6 of the grpo.prompts_per_step \* rollout.n_samples = 3 \* 8 = 24 responses over 4 "
     r"data-parallel replicas .* grpo.mini_batches=4 .*grpo.micro_batch_size=2"),
    # 12 rows do not split over 8 replicas at all
    (["grpo.prompts_per_step=3", "rollout.n_samples=4", "advantage.group_size=4", "grpo.micro_batch_size=1"], 8,
     r"= 3 \* 4 = 12 responses do not split over 8 data-parallel replicas \(world size 8 / "
     r"\(parallel.tensor_parallel=1 x parallel.pipeline_parallel=1\)\)"),
    # 16 rows, 2 per replica on DP=8: fine for mini-batches, not for micro-batches of 4
    (["grpo.prompts_per_step=4", "rollout.n_samples=4", "advantage.group_size=4", "grpo.micro_batch_size=4"], 8,
     r"each replica's 2 of .* 16 responses over 8 .*grpo.micro_batch_size=4 micro-batches"),
    (["warm_start.sft_steps=1", "warm_start.sft_batch_size=6", "grpo.prompts_per_step=4", "rollout.n_samples=4",
      "advantage.group_size=4", "grpo.micro_batch_size=1"], 4,
     r"warm_start.sft_batch_size=6 does not split over 4 data-parallel replicas"),
]


@pytest.mark.parametrize("overrides,world,message", PER_REPLICA)
def test_batches_that_do_not_split_per_replica_are_rejected(overrides, world, message):
    cfg = load(overrides)  # splits at DP=1
    with pytest.raises(ConfigError, match=message):
        cfg.check_world_size(world)


def test_check_config_names_the_per_replica_split():
    overrides = PER_REPLICA[0][0]
    bad = _megadiv("check-config", *NEW_MODEL, *overrides, "--world-size", "8")
    assert bad.returncode == 2 and "each replica's 6" in bad.stderr and "grpo.mini_batches=4" in bad.stderr
    good = _megadiv("check-config", *NEW_MODEL, *overrides, "grpo.mini_batches=3", "--world-size", "8")
    assert good.returncode == 0, good.stderr
    assert load([*overrides, "grpo.mini_batches=3"]).check_world_size(8) == 4


def test_stage_layers_and_recompute_are_validated():
    cfg = load(["model.num_layers=4", "parallel.pipeline_parallel=2", "parallel.stage_layers=[1, 3]",
                "model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"])
    assert cfg.parallel.stage_layers == [1, 3] and cfg.model.recompute_method == "uniform"
    assert load(["model.recompute_granularity=selective"]).model.recompute_granularity == "selective"
    for overrides, message in [
        (["model.num_layers=4", "parallel.pipeline_parallel=2", "parallel.stage_layers=[1, 2]"],
         r"parallel.stage_layers=\[1, 2\] places 3 layers; the model has 4"),
        (["parallel.pipeline_parallel=2", "parallel.stage_layers=[2]"], "each of the parallel.pipeline_parallel=2"),
        (["model.num_layers=8", "parallel.pipeline_parallel=4", "parallel.stage_layers=[1, 2, 3, 2]"],
         "middle stages equal"),
        (["model.recompute_granularity=full"], "set exactly when model.recompute_granularity is 'full'"),
        (["model.recompute_granularity=selective", "model.recompute_method=block", "model.recompute_num_layers=1"],
         "set exactly when"),
        (["model.recompute_granularity=full", "model.recompute_method=block", "model.recompute_num_layers=3"],
         "model.recompute_num_layers=3 exceeds the 2 layers"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load(overrides)


def test_context_parallel_is_not_a_key():
    with pytest.raises(ConfigError, match="unknown config key 'parallel.context_parallel'"):
        load(["parallel.context_parallel=2"])


def test_hf_dir_supplies_the_head_counts(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 9, "num_key_value_heads": 3, '
                                          '"num_hidden_layers": 30}')
    assert load([f"model.hf_dir={tmp_path}", "parallel.tensor_parallel=3", "warm_start.make_model=none"]).model.heads() == (30, 9, 3)
    with pytest.raises(ConfigError, match="does not divide the 9 attention heads"):
        load([f"model.hf_dir={tmp_path}", "parallel.tensor_parallel=2"])
    with pytest.raises(ConfigError, match="holds no config.json"):
        load([f"model.hf_dir={tmp_path / 'missing'}", "warm_start.make_model=none"])


def test_valid_keys_lists_sections_and_leaves():
    keys = valid_keys(TrainConfig)
    assert "parallel" in keys and "parallel.tensor_parallel" in keys and "optim.lr" in keys


def _megadiv(*args):
    return subprocess.run([sys.executable, "-m", "megadiv.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_train_rejects_bad_config_before_starting_anything(yaml_file):
    path = yaml_file("model: {hf_dir: /nonexistent/m}\nwarm_start: {make_model: qwen2}\n")
    bad_key = _megadiv("train", str(path), "bogus.key=1")
    assert bad_key.returncode != 0 and "bogus.key" in bad_key.stderr
    bad_tp = _megadiv("train", str(path), "parallel.tensor_parallel=3", "--nproc", "3")
    assert bad_tp.returncode != 0 and "attention heads" in bad_tp.stderr
    bad_world = _megadiv("train", str(path), "parallel.tensor_parallel=2", "--nproc", "3")
    assert bad_world.returncode != 0 and "world size 3" in bad_world.stderr
    # options may sit between the config and the overrides: the override after --nproc is still read
    between = _megadiv("train", str(path), "--nproc", "3", "parallel.tensor_parallel=2")
    assert between.returncode == 2 and "world size 3" in between.stderr


def test_cli_help_lists_the_verbs():
    out = _megadiv("--help")
    assert out.returncode == 0
    for verb in ("train", "check-config", "bounds", "convert"):
        assert verb in out.stdout


def test_config_reference_is_current():
    """docs/config_reference.md is generated from the dataclasses; regenerate it with
    `python -m megadiv.cli.config_docs > docs/config_reference.md` after changing a key."""
    from pathlib import Path

    from megadiv.cli.config_docs import render

    committed = (Path(__file__).resolve().parents[1] / "docs" / "config_reference.md").read_text()
    assert committed == render(), "docs/config_reference.md is stale"


@pytest.mark.parametrize("family", ["mistral", "olmo2"])
def test_make_model_without_megatron_mapping_is_refused_for_megatron(family):
    with pytest.raises(ConfigError, match=f"make_model={family}: megadiv has no Megatron mapping .*model.backend=deepspeed"):
        load([f"warm_start.make_model={family}"])
    cfg = load([f"warm_start.make_model={family}", "model.backend=deepspeed"])  # the backend that trains it
    assert cfg.warm_start.make_model == family


def _in_process(capsys, *args: str) -> tuple[int, list[str]]:
    """``megadiv ARGS`` in this process: (exit code, the lines of stderr)."""
    from megadiv.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse
        rc = e.code
    return rc, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("args,message", [
    (["rollout.temperature=0"], "rollout.temperature=0 samples greedily"),
    (["optim.lr=nan"], "optim.lr: nan is not a finite number"),
    (["loss.delta=.inf"], "loss.delta: inf is not a finite number"),
    (["rollout.top_p=-.inf"], "rollout.top_p: -inf is not a finite number"),
    (["--world-size", "0"], "the world size must be >= 1 rank, got 0"),
    (["--world-size", "-2"], "the world size must be >= 1 rank, got -2"),
], ids=["temperature-0", "lr-nan", "delta-inf", "top_p-minus-inf", "world-0", "world-minus-2"])
def test_values_that_cannot_train_are_refused_in_one_line(capsys, tmp_path, args, message):
    """Issue 27: each refused by check-config with exit code 2 and one line, and by train before any
    rank starts (the same line, no torchrun)."""
    base = [*NEW_MODEL, f"run.output_dir={tmp_path}"]
    rc, err = _in_process(capsys, "check-config", *base, *args)
    assert rc == 2 and len(err) == 1 and message in err[0] and err[0].startswith("megadiv: invalid config: "), err
    if "--world-size" not in args:
        rc, err = _in_process(capsys, "train", *base, *args, "--nproc", "2")
        assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not any(tmp_path.iterdir())  # nothing written
    if message.startswith("rollout.temperature"):
        assert "GRPO cannot learn" in err[0]


def test_make_tiny_model_refuses_an_existing_directory_unless_forced(capsys, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = _in_process(capsys, "make-tiny-model", "--family", "qwen2", "--out", str(out))
    assert rc == 2 and err == [f"megadiv make-tiny-model: error: {out} exists: choose a new directory, or pass --force "
                               f"to replace it"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    rc, _ = _in_process(capsys, "make-tiny-model", "--family", "qwen2", "--out", str(out), "--force")
    assert rc == 0 and (out / "config.json").is_file() and not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no partial directory left beside it


def test_a_recipe_is_checked_before_its_weights_are_on_disk(capsys, tmp_path):
    """model.hf_dir=/checkpoints/Qwen3-8B is absent: check-config and plan take the architecture from
    examples/hf_configs/Qwen3-8B (or --hf-config) and say so; the printed config keeps the real path."""
    from megadiv.cli.stand_in import HF_CONFIGS

    recipe = [f"examples/gsm8k/{f}" for f in ("task.yaml", "models/qwen3-8b.yaml", "algorithms/grpo.yaml")]
    recipe = [str(Path(__file__).resolve().parents[1] / f) for f in recipe] + [f"run.output_dir={tmp_path}"]
    rc, err = _in_process(capsys, "check-config", *recipe, "--world-size", "8")
    public = HF_CONFIGS / "Qwen3-8B" / "config.json"
    sync = ("megadiv: rollout.sync_method: auto -> tensor for servers launched on GPUs the trainer's ranks hold "
            "(CUDA-IPC handles, as when the ranks fill the node), distributed on GPUs of their own or on a CPU")
    assert rc == 0 and err == [f"megadiv: model.hf_dir=/checkpoints/Qwen3-8B holds no config.json yet; checking the "
                               f"architecture of {public} (the public config of Qwen3-8B) in its place; the weights "
                               f"are not checked", sync], err
    mine = tmp_path / "config.json"
    mine.write_text(public.read_text())
    rc, err = _in_process(capsys, "check-config", *recipe, "--hf-config", str(mine), "--world-size", "8")
    assert rc == 0 and err == [f"megadiv: checking the architecture of {mine} (--hf-config) in place of "
                               f"model.hf_dir=/checkpoints/Qwen3-8B; its weights are not checked", sync], err
    rc, err = _in_process(capsys, "check-config", *recipe, "parallel.tensor_parallel=3", "--world-size", "24")
    assert rc == 2 and "does not divide the 32 attention heads" in err[-1]  # the architecture is really checked
    rc, err = _in_process(capsys, "plan", *recipe, "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gib", "80")
    assert rc == 0 and "examples/hf_configs/Qwen3-8B/config.json" in err[0]
    # without a public config of that name: the error says how to check before downloading
    rc, err = _in_process(capsys, "check-config", *recipe, "model.hf_dir=/checkpoints/MyModel")
    assert rc == 2 and len(err) == 1 and "--hf-config FILE" in err[0] and "make_model" not in err[0], err


def test_a_created_model_follows_the_run_directory(tmp_path):
    cfg = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "examples" / "tiny" / "grpo.yaml",
                      [f"run.output_dir={tmp_path}", "run.name=elsewhere"])
    assert cfg.model.hf_dir == str(tmp_path / "elsewhere" / "init")


def test_distributed_optimizer_key_is_honest():
    """optim.distributed_optimizer: unset means Adam's state is sharded at DP > 1 and not at DP = 1
    (nothing to shard); true/false hold at every DP size; true with SGD (no state to shard) and any
    value with the DeepSpeed backend (its own ZeRO) are refused."""
    from megadiv.config import ModelConfig, OptimConfig

    assert [OptimConfig().shards_state(dp) for dp in (1, 2, 4)] == [False, True, True]
    assert [OptimConfig(distributed_optimizer=True).shards_state(dp) for dp in (1, 2)] == [True, True]
    assert [OptimConfig(distributed_optimizer=False).shards_state(dp) for dp in (1, 2)] == [False, False]
    assert not OptimConfig(optimizer="sgd").shards_state(2)
    with pytest.raises(ConfigError, match="sgd"):
        OptimConfig(optimizer="sgd", distributed_optimizer=True)
    with pytest.raises(ConfigError, match="optim.distributed_optimizer"):
        TrainConfig(model=ModelConfig(hf_dir=str(Path(__file__).parents[1] / "examples/hf_configs/Qwen3-1.7B"), backend="deepspeed"), optim=OptimConfig(distributed_optimizer=False))
