"""The memory planner (megadiv.models.plan, ``megadiv plan``) against megatron-core on CPU and
against the published model configs.

Exact: per-rank parameter lists and the bytes megatron allocates for weights, fp32 gradient
buffers, fp32 main params and Adam state at four TP x PP x DP layouts on 4 ranks (DP = 4, 2, 2, 1;
the distributed optimizer's padding and DP shards included), and SGD's momentum at DP = 4, for a
tied Qwen2 and an untied Qwen3.
Within 25% (observed: see the assertion): the activations one micro-batch saves for backward.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megadiv.models.families import arch_from_hf_config
from megadiv.models.hf_config import load_hf_config
from megadiv.models.plan import (
    boundary_activation_bytes,
    layer_activation_bytes,
    parameter_count,
    stage_params,
    state_bytes,
)
from tests.torchrun import run_torchrun

MICRO_BATCH, SEQ_LEN = 2, 48
GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    from megadiv.models.tiny import make_tiny_model
    root = tmp_path_factory.mktemp("plan")
    shape = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128)
    return {"qwen2-tied": str(make_tiny_model(root / "qwen2", "qwen2", tied=True, **shape)),
            "qwen3-untied": str(make_tiny_model(root / "qwen3", "qwen3", tied=False, head_dim=16, **shape))}


@pytest.fixture(scope="module")
def allocations(tiny_models) -> list[dict]:
    ranks = run_torchrun("tests.dist.plan:allocations", nproc=4, timeout_s=600,
                         args={"models": tiny_models, "micro_batch": MICRO_BATCH,
                               "seq_len": SEQ_LEN})
    return [record for rank in ranks for record in rank]


@pytest.mark.slow
def test_planned_parameters_gradients_and_optimizer_state_equal_megatrons(allocations, tiny_models):
    layouts = set()
    for r in allocations:
        arch = arch_from_hf_config(load_hf_config(tiny_models[r["model"]]))
        params = stage_params(arch, r["tp"], r["pp"], r["pp_rank"])
        assert [(p.name, p.numel) for p in params] == r["params"], r
        state = state_bytes(params, "bfloat16", r["opt"], r["dp"], r["dp_rank"])
        measured = {k: r[k] for k in ("weights", "grads", "main_params", "optimizer")}
        assert measured == {"weights": state.weights, "grads": state.grads, "main_params": state.main_params,
                            "optimizer": state.optimizer}, (r["model"], r["tp"], r["pp"], r["dp_rank"])
        layouts.add((r["tp"], r["pp"], r["dp"], r["opt"]))
    assert layouts == {(1, 1, 4, "adam"), (2, 1, 2, "adam"), (1, 2, 2, "adam"), (2, 2, 1, "adam"), (1, 1, 4, "sgd")}
    # the distributed optimizer's shards differ between DP ranks and cover every parameter once
    dp4 = [r for r in allocations if r["dp"] == 4 and r["model"] == "qwen3-untied" and r["opt"] == "adam"]
    assert len({r["optimizer"] for r in dp4}) > 1
    assert sum(r["optimizer"] for r in dp4) == 8 * sum(n for _, n in dp4[0]["params"])


@pytest.mark.slow
def test_planned_activations_are_within_25_percent_of_the_saved_tensors(allocations, tiny_models):
    ratios = {}
    for r in (r for r in allocations if "saved_activations" in r):
        arch = arch_from_hf_config(load_hf_config(tiny_models[r["model"]]))
        planned = (arch.num_layers * layer_activation_bytes(arch, r["tp"], MICRO_BATCH, SEQ_LEN, "bfloat16", "local")
                   + boundary_activation_bytes(arch, r["tp"], MICRO_BATCH, SEQ_LEN, "bfloat16", "local", True, True))
        ratios[(r["model"], r["tp"])] = planned / r["saved_activations"]
    assert len(ratios) == 4
    assert all(abs(q - 1) < 0.25 for q in ratios.values()), ratios
    print("planned / measured activations:", {k: round(v, 4) for k, v in ratios.items()})


@pytest.mark.parametrize("family, tied", [("qwen2", True), ("qwen3", False), ("llama", False)])
def test_parameter_count_is_the_hugging_face_models(tmp_path, family, tied):
    from transformers import AutoModelForCausalLM

    from megadiv.models.tiny import make_tiny_model
    hf_dir = make_tiny_model(tmp_path / family, family, tied=tied, layers=3, hidden=64, heads=4, kv_heads=2, ffn=96)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert parameter_count(arch_from_hf_config(load_hf_config(hf_dir))) == model.num_parameters()


# --------------------------------------------------------------------------- the CLI and the recipes

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "examples" / "gsm8k"
HF_CONFIGS = REPO / "examples" / "hf_configs"
RECIPES_32B = {"qwen2.5-32b": "Qwen2.5-32B", "qwen3-32b": "Qwen3-32B"}


def hf_parameter_count(config_dir: Path) -> int:
    """transformers' own count, the model built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).num_parameters()


def plan_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from megadiv.cli import main
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def recipe_args(model: str, algorithm: str, nodes: int, hf_config: str | None = None) -> list[str]:
    """``megadiv plan`` of a GSM8K recipe on ``nodes`` x 8 GPUs of 80 GB, the architecture from
    examples/hf_configs/``hf_config`` (default: the 32B recipe's)."""
    return [str(GSM8K / "task.yaml"), str(GSM8K / "models" / f"{model}.yaml"),
            str(GSM8K / "algorithms" / f"{algorithm}.yaml"),
            "--hf-config", str(HF_CONFIGS / (hf_config or RECIPES_32B[model]) / "config.json"),
            "--nodes", str(nodes), "--gpus-per-node", "8", "--gpu-memory-gib", "80"]


def test_acceptance_qwen2_5_32b_parameters_and_weight_bytes(capsys):
    rc, out, _ = plan_cli(capsys, *recipe_args("qwen2.5-32b", "dapo", 2), "--json")
    plan = json.loads(out)
    expected = hf_parameter_count(HF_CONFIGS / "Qwen2.5-32B")
    assert rc == 0 and abs(plan["parameters"] / expected - 1) < 0.01
    assert abs(plan["weight_bytes_per_replica"] / (2 * plan["parameters"]) - 1) < 0.01  # bf16
    assert plan["layout"] == {"tp": 8, "pp": 2, "dp": 1, "ep": 1, "etp": 8} and plan["fits"]
    assert plan["per_gpu_bytes"] == sum(plan["components"].values())


@pytest.mark.parametrize("model", sorted(RECIPES_32B))
@pytest.mark.parametrize("algorithm", ["dapo", "kl3", "prob_l2"])
@pytest.mark.parametrize("nodes", [2, 4])
def test_32b_recipes_fit_on_8_gpu_nodes_of_80_gb(capsys, model, algorithm, nodes):
    rc, out, err = plan_cli(capsys, *recipe_args(model, algorithm, nodes), "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["fits"] and plan["layout"] == {"tp": 8, "pp": 2, "dp": nodes // 2, "ep": 1, "etp": 8}
    assert (plan["components"]["reference_weights"] > 0) == (algorithm == "prob_l2")  # a regulariser needs it


def test_logits_are_planned_at_the_response_positions_only(capsys):
    """The output layer sees only the positions that predict response tokens (models/output.py):
    the planned logits do not grow with the prompt, and grow linearly with rollout.max_new_tokens
    (fixed micro-batches: under the recipe's token budget a longer prompt leaves fewer rows)."""
    def components(prompt_tokens: int, *overrides: str) -> dict:
        rc, out, err = plan_cli(capsys, *recipe_args("qwen3-32b", "dapo", 2), "grpo.max_tokens_per_micro_batch=null",
                                "grpo.pack_sequences=false", *overrides,
                                "--prompt-tokens", str(prompt_tokens), "--json")
        assert rc == 0, err
        return json.loads(out)["stages"][-1]["components"]  # the last stage holds the logits
    short, long = components(256), components(4096)
    assert short["logits"] == long["logits"] > 0 and long["activations"] > short["activations"]
    one, two = components(256, "rollout.max_new_tokens=1000"), components(256, "rollout.max_new_tokens=2000")
    assert two["logits"] == 2 * one["logits"]


def test_rank0_counts_the_sync_buffers_and_the_host_memory_of_a_checkpoint(capsys):
    """Attached servers: rank 0 holds the bucket exported ahead while the one before is sent, and
    with the fleet's broadcast group one flattened copy of a bucket and one NCCL communicator,
    whatever the fleet's size; without one (sync_method=disk) the buckets queued for each
    member's sync. Its host holds the model-space optimizer state the
    checkpoint gathers, its staged share of the weights and the batch. A host too small for that
    makes the layout not fit."""
    from megadiv.cli.plan import QUEUE_DEPTH
    from megadiv.models.plan import (
        DRIVER_PROMPT_BYTES_PER_TOKEN,
        DRIVER_RESPONSE_BYTES_PER_TOKEN,
        NCCL_COMMUNICATOR_BYTES,
    )

    def plan(servers: int, *extra: str) -> dict:
        urls = ",".join(f"http://node{i}:30000" for i in range(servers))
        rc, out, err = plan_cli(capsys, *recipe_args("qwen3-32b", "dapo", 2), f"rollout.server_urls=[{urls}]",
                                "--json", *extra)
        assert rc == 0, err
        return json.loads(out)

    one, four, disk = plan(1), plan(4), plan(4, "rollout.sync_method=disk")
    bucket = 1 << 30  # examples/gsm8k/task.yaml's rollout.bucket_bytes
    for p in (one, four):
        first, last = p["stages"][0]["components"], p["stages"][-1]["components"]
        assert first["sync_communicators"] == NCCL_COMMUNICATOR_BYTES and last["sync_communicators"] == 0
        assert first["weight_sync_buckets"] == 3 * bucket and last["weight_sync_buckets"] == bucket
    first = disk["stages"][0]["components"]
    assert first["sync_communicators"] == 0 and first["weight_sync_buckets"] == bucket * (1 + 1 + QUEUE_DEPTH + 1)
    host = four["host_components"]
    # the driver's lists: prompts_per_step x n_samples responses of rollout.max_new_tokens, each
    # prompt's 512 tokens once; with grpo.overlap the batch generated ahead too
    batch = 64 * 8 * 2048 * DRIVER_RESPONSE_BYTES_PER_TOKEN + 64 * 512 * DRIVER_PROMPT_BYTES_PER_TOKEN
    assert host["driver_batch"] == batch
    assert plan(4, "grpo.overlap=true", "loss.tis_cap=2.0")["host_components"]["driver_batch"] == 2 * batch
    # the first stage's slice in model space: 3 fp32 tensors (main weight, two moments); at DP=1 the
    # GPU's fp32 main weights are the whole slice
    assert host["optimizer_state_gathered"] == 3 * four["stages"][0]["components"]["main_params_fp32"]
    assert four["host_bytes_per_rank"] == 2048 * GIB // 8 and four["host_fits"] and four["fits"]
    small = plan(4, "--host-memory-gib", "128")  # 16 GiB per rank: less than the gathered state
    assert not small["host_fits"] and not small["fits"]
    rc, out, _ = plan_cli(capsys, *recipe_args("qwen3-32b", "dapo", 2), "--host-memory-gib", "128")
    assert rc == 0 and "of 16 GiB per rank (128 GiB per node): does NOT fit" in out


def test_shipped_configs_count_as_transformers_does():
    configs = sorted(HF_CONFIGS.glob("*/config.json"))
    assert {c.parent.name for c in configs} >= {"Qwen2.5-32B", "Qwen3-32B", "Qwen3-8B", "Qwen3-1.7B",
                                                "Qwen2.5-Math-1.5B", "Qwen3-4B-Instruct-2507"}
    for c in configs:
        assert parameter_count(arch_from_hf_config(json.loads(c.read_text()))) == hf_parameter_count(c.parent), c


@pytest.mark.parametrize("name, total, active", [("Qwen3-30B-A3B", 30.5e9, 3.3e9), ("Qwen3-235B-A22B", 235e9, 22e9)])
def test_moe_counts_match_the_published_total_and_active_parameters(name, total, active):
    """Qwen's model cards: 30.5B total / 3.3B activated, 235B / 22B (the exact total is
    transformers' count, test_shipped_configs_count_as_transformers_does)."""
    arch = arch_from_hf_config(json.loads((HF_CONFIGS / name / "config.json").read_text()))
    assert round(parameter_count(arch) / total, 2) == 1.0
    assert round(parameter_count(arch, active=True) / active, 1) == 1.0  # 3.35B is "3.3B", 22.19B "22B"


def test_scaling_doc_shows_the_planners_tables(capsys, monkeypatch):
    """Each ```text block after a `<!-- megadiv plan ARGS -->` marker in docs/scaling.md is what
    `megadiv plan ARGS` prints now."""
    import re
    import shlex
    monkeypatch.chdir(REPO)  # the markers' paths are relative to the repository
    doc = (REPO / "docs" / "scaling.md").read_text()
    blocks = re.findall(r"<!-- megadiv plan (.+?) -->\n```text\n(.*?)```", doc, flags=re.S)
    assert len(blocks) == 4
    for args, shown in blocks:
        rc, out, err = plan_cli(capsys, *shlex.split(args))
        assert rc == 0, err
        assert out == shown, f"docs/scaling.md is stale for `megadiv plan {args}`"


def test_plan_errors_name_the_problem(capsys, tmp_path):
    args = recipe_args("qwen3-32b", "dapo", 2)
    rc, _, err = plan_cli(capsys, *args[:3], "--hf-config", str(tmp_path / "missing.json"), *args[5:])
    assert rc == 2 and "missing.json" in err
    rc, _, err = plan_cli(capsys, *args[:-6], "--nodes", "1", "--gpus-per-node", "12", "--gpu-memory-gib", "80")
    assert rc == 2 and "world size 12" in err


@pytest.mark.parametrize("model", sorted(p.stem for p in (GSM8K / "models").glob("*.yaml")))
def test_every_gpu_of_node_0_generates_in_the_colocated_recipes(capsys, model):
    """Launched servers take node 0's GPUs between training phases: the recipes launch enough of
    them (rollout.num_servers x server_tp = 8) that none of those GPUs sits idle while the fleet
    generates, and the plan prints them with the memory each GPU gives them."""
    text = (GSM8K / "models" / f"{model}.yaml").read_text()
    hf_config = HF_CONFIGS / Path(yaml.safe_load(text)["model"]["hf_dir"]).name / "config.json"
    args = [str(GSM8K / "task.yaml"), str(GSM8K / "models" / f"{model}.yaml"), str(GSM8K / "algorithms" / "grpo.yaml"),
            "--hf-config", str(hf_config), "--nodes", "16" if "235b" in model else "2", "--gpus-per-node", "8",
            "--gpu-memory-gib", "80"]
    rc, out, err = plan_cli(capsys, *args, "--json")
    assert rc == 0, err
    servers = json.loads(out)["launched_servers"]
    if "server_urls" in text:
        assert servers is None
        return
    assert servers["gpus"] == 8 and servers["idle_gpus"] == 0, servers
    rc, out, _ = plan_cli(capsys, *args)
    assert f"generation: {servers['count']} SGLang server(s) of TP={servers['tp']} on GPUs 0-7 of node 0" in out
    rc, _, err = plan_cli(capsys, *args, f"rollout.num_servers={servers['count'] + 1}")
    assert rc == 2 and f"needs {8 + servers['tp']} GPUs on node 0, which has 8" in err


def test_the_drivers_batch_costs_what_the_planner_charges_per_token():
    """The rollout driver's Experience (Python lists of ints and floats) re-measured with tracemalloc:
    within 10% of the planner's bytes per response and per prompt token."""
    import random
    import tracemalloc

    from megadiv.divergence import AdvantageConfig
    from megadiv.models.plan import DRIVER_PROMPT_BYTES_PER_TOKEN, DRIVER_RESPONSE_BYTES_PER_TOKEN
    from megadiv.rollout import Completion
    from megadiv.trainer.experience import build_experience
    groups, group_size, prompt_len, response_len = 8, 8, 512, 1024
    rng = random.Random(0)
    tracemalloc.start()
    try:  # token ids past CPython's small-int cache, as a 150k vocabulary's are
        prompts = [[rng.randrange(1000, 150_000) for _ in range(prompt_len)] for _ in range(groups)]
        prompt_bytes = tracemalloc.get_traced_memory()[0]
        completions = [[Completion([rng.randrange(1000, 150_000) for _ in range(response_len)],
                                   [-rng.random() for _ in range(response_len)], "length", "v0")
                        for _ in range(group_size)] for _ in range(groups)]
        experience = build_experience(prompts, completions, [float(i % 2) for i in range(groups * group_size)],
                                      ["correct"] * (groups * group_size), AdvantageConfig(group_size=group_size),
                                      response_len)
        total = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(experience) == groups * group_size
    per_prompt_token = prompt_bytes / (groups * prompt_len)
    per_response_token = (total - prompt_bytes) / (groups * group_size * response_len)
    assert abs(per_prompt_token / DRIVER_PROMPT_BYTES_PER_TOKEN - 1) < 0.1, per_prompt_token
    assert abs(per_response_token / DRIVER_RESPONSE_BYTES_PER_TOKEN - 1) < 0.1, per_response_token


@pytest.mark.parametrize("algorithm, passes", [("dapo", 2 + 6), ("grpo", 2 + 2 + 6)])
def test_checkpoint_every_is_youngs_rule_over_the_printed_assumptions(capsys, algorithm, passes):
    """Recomputed by hand from what --json prints: step seconds from FLOPs (old-policy pass 2,
    training 6, a KL's reference pass 2 per token and active parameter) at the stated MFUs, blocking
    seconds from rank 0's host bytes at the stated copy bandwidth, the MTBF per node over the nodes;
    checkpoint.node_mtbf_hours moves the recommendation as sqrt(MTBF)."""
    import math

    def advice(*extra: str) -> tuple[dict, dict]:
        rc, out, err = plan_cli(capsys, *recipe_args("qwen3-32b", algorithm, 8), "--json", *extra)
        assert rc == 0, err
        plan = json.loads(out)
        return plan, plan["checkpoint_interval"]

    plan, a = advice()
    k, host = a["assumptions"], plan["host_components"]
    assert a["flops_per_token_per_parameter"] == passes and a["nodes"] == 8 and a["train_gpus"] == 64
    assert a["train_tokens"] == 64 * 8 * (512 + 2048) and a["generated_tokens"] == 64 * 8 * 2048
    assert a["active_parameters"] == plan["parameters"] and a["generation_gpus"] == 8  # one TP8 server
    train = passes * a["active_parameters"] * a["train_tokens"] / (64 * k["GPU_PEAK_FLOPS"] * k["TRAIN_MFU"])
    generation = 2 * a["active_parameters"] * a["generated_tokens"] / (8 * k["GPU_PEAK_FLOPS"] * k["DECODE_MFU"])
    blocking = ((k["GATHERED_STATE_HOST_COPIES"] * host["optimizer_state_gathered"] + host["checkpoint_staging"])
                / k["HOST_COPY_BYTES_PER_S"])
    mtbf = a["node_mtbf_hours"] * 3600 / 8
    assert a["step_s"] == pytest.approx(train + generation) and a["blocking_s"] == pytest.approx(blocking)
    assert a["every"] == max(1, round(math.sqrt(2 * blocking * mtbf) / (train + generation)))
    _, overlapped = advice("grpo.overlap=true", "loss.tis_cap=2.0")
    assert overlapped["step_s"] == pytest.approx(max(train, generation))
    _, rare = advice(f"checkpoint.node_mtbf_hours={a['node_mtbf_hours'] * 4}")
    assert rare["every"] == round(math.sqrt(2 * blocking * 4 * mtbf) / (train + generation)) > a["every"]
    rc, out, _ = plan_cli(capsys, *recipe_args("qwen3-32b", algorithm, 8))
    assert f"checkpoint.every: {a['every']} recommended" in out and "0.35 MFU" in out
