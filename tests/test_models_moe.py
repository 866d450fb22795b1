"""Mixture-of-experts (Qwen3-MoE) models and expert parallelism, against transformers and EP=1.

Observed on the CPU tier (float32): logits within 5.4e-7 of transformers (max abs; tolerance
2e-6), bit-exact export and HF -> megatron -> HF round trip; at EP=2 (2 ranks) and DP=4 x EP=2
(4 ranks, slow tier) log-probs equal to EP=1 and gradients within 4.5 float32 ulps of each
tensor's largest entry (tolerance 8), and the EP=2 checkpoint reloading at EP=1 bitwise.
"""
import json
from pathlib import Path

import pytest
import torch

from tests.dist.models_moe import LAYOUTS, make_moe_models
from tests.torchrun import run_torchrun

LOGIT_TOL = 2e-6
ULPS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_moe_models(tmp_path_factory.mktemp("tiny-moe"))


def _launch(body: str, nproc: int, models, tmp_path_factory) -> list[dict]:
    results = run_torchrun(f"tests.dist.models_moe:{body}", nproc, timeout_s=400,
                           args={"models": models, "tmp": str(tmp_path_factory.mktemp(body))})
    print(f"\n{body}:", results)  # the figures, with pytest -s
    return results


@pytest.fixture(scope="module")
def one(models, tmp_path_factory):
    return _launch("one_rank", 1, models, tmp_path_factory)[0]


@pytest.fixture(scope="module")
def two(models, tmp_path_factory):
    return _launch("two_ranks", 2, models, tmp_path_factory)


def test_tiny_qwen3_moe_checkpoint(models):
    import json
    from pathlib import Path

    from megadiv.models.families import arch_from_hf_config

    cfg = json.loads((Path(models["moe"]) / "config.json").read_text())
    arch = arch_from_hf_config(cfg)
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_ffn_hidden_size, arch.moe_norm_topk_prob) == (8, 2, 32, True)


@pytest.mark.parametrize("extra,message", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
    ({"shared_expert_intermediate_size": 64}, "shared experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
])
def test_unsupported_moe_configs_are_refused(models, extra, message):
    import json
    from pathlib import Path

    from megadiv.config import ConfigError
    from megadiv.models.families import arch_from_hf_config

    cfg = json.loads((Path(models["moe"]) / "config.json").read_text())
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        arch_from_hf_config({**cfg, **extra})


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_logits_equal_transformers(one, family):
    r = one if family == "qwen3_moe" else one["shared"]
    assert r["logit_diff"] <= LOGIT_TOL, r["logit_diff"]
    assert r["padding_logit_max"] == 0.0


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_export_and_views_are_bit_exact(one, family):
    r = one if family == "qwen3_moe" else one["shared"]
    assert r["expert_tensors"] == 2 * 8 * 3  # layers x experts x (gate, up, down)
    assert r["export_exact"] and r["views_exact"] and r["buckets"] > 1


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_hf_megatron_hf_roundtrip_bit_exact(one, family):
    r = one if family == "qwen3_moe" else one["shared"]
    assert r["cli_rc"] == (0, 0)
    assert r["roundtrip_exact"]


def test_planned_parameter_count_equals_megatrons_and_transformers(models, one, two):
    """megadiv.models.plan.parameter_count of the tiny Qwen3-MoE: what megatron allocates at EP=1
    (less the vocabulary padding), at EP=2 (the dense part on every rank, half the experts each)
    and what transformers counts; the active count by hand (router + top-2 of 8 experts)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from megadiv.models.families import arch_from_hf_config
    from megadiv.models.hf_config import load_hf_config
    from megadiv.models.plan import parameter_count

    arch = arch_from_hf_config(load_hf_config(Path(models["moe"])))
    total = parameter_count(arch)
    at_ep1 = one["param_numel"]
    assert at_ep1["dense"] + at_ep1["experts"] - at_ep1["vocab_padding"] == total
    assert AutoModelForCausalLM.from_pretrained(models["moe"]).num_parameters() == total
    assert [r["param_numel"]["dense"] for r in two] == [at_ep1["dense"]] * 2
    assert [r["param_numel"]["experts"] for r in two] == [at_ep1["experts"] // 2] * 2
    one_expert = 3 * arch.hidden_size * arch.moe_ffn_hidden_size
    assert total - parameter_count(arch, active=True) == arch.num_layers * (8 - 2) * one_expert


def test_the_router_computes_in_float64_on_gpus(monkeypatch):
    """On a GPU megatron computes the router's GEMM with Transformer Engine's, which takes float32 in
    TF32: the model config asks for float64 there (megatron then uses torch's matmul), and keeps the
    model's dtype on a CPU (no TF32). The device query is faked; the config is megatron's own."""
    from megadiv.config import ModelConfig
    from megadiv.models.builder import transformer_config
    from megadiv.models.families import FAMILIES, arch_from_hf_config

    public = Path(__file__).resolve().parents[1] / "examples" / "hf_configs" / "Qwen3-30B-A3B" / "config.json"
    arch = arch_from_hf_config(json.loads(public.read_text()))
    args = dict(tp=1, pp=1, vpp=None, sequence_parallel=False, stage_layers=[arch.num_layers], initialize=False)
    assert transformer_config(arch, FAMILIES["qwen3_moe"], ModelConfig(), **args).moe_router_dtype is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert transformer_config(arch, FAMILIES["qwen3_moe"], ModelConfig(), **args).moe_router_dtype == "fp64"


def test_experts_are_named_by_their_global_index_in_either_spec():
    """megatron's SequentialMLP (local spec) and Transformer Engine's TEGroupedMLP name rank 1's
    (of EP=2) local expert 3 differently; megadiv's canonical name, which the weight table, export
    and checkpoints key on, is the same global expert 7 for both."""
    from megadiv.models.loading import canonical_expert_name

    experts = [4, 5, 6, 7]  # mlp.local_expert_indices on EP rank 1 of 2, 8 experts
    for fc in ("linear_fc1", "linear_fc2"):
        want = f"mlp.experts.local_experts.7.{fc}.weight"
        assert canonical_expert_name(f"mlp.experts.local_experts.3.{fc}.weight", experts) == want
        assert canonical_expert_name(f"mlp.experts.{fc}.weight3", experts) == want
    for other in ("mlp.router.weight", "mlp.shared_experts.linear_fc1.weight", "mlp.linear_fc1.layer_norm_weight"):
        assert canonical_expert_name(other, experts) == other


def test_ep2_holds_half_the_experts_each(two):
    assert [r["ep_rank"] for r in two] == [0, 1]
    assert [r["experts_held"] for r in two] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(r["dp_size"] == 2 and r["expert_dp_size"] == 1 for r in two)


def _check_ep2_vs_ep1(results: list[dict]):
    for r in results:
        assert r["grad_names_match"]
        assert r["logp_diff"] <= 1e-6, r["logp_diff"]
        # per tensor, in float32 ulps of its largest entry: sums over tokens and ranks in another order
        assert max(r["dense_grad_ulps"], r["expert_grad_ulps"], r["router_grad_ulps"]) <= ULPS, r
        assert r["experts_without_grad"] == []


def test_ep2_log_probs_and_gradients_equal_ep1(two):
    _check_ep2_vs_ep1(two)
    _check_ep2_vs_ep1([r["shared"] for r in two])  # the Qwen2-MoE: shared expert and its gate too


@pytest.mark.slow  # the 4-rank launch on 2 cores
def test_dp4_ep2_log_probs_and_gradients_equal_ep1(models, tmp_path_factory):
    four = _launch("four_ranks", 4, models, tmp_path_factory)
    assert [r["ep_rank"] for r in four] == [0, 1, 0, 1]
    assert [r["experts_held"] for r in four] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert all(r["dp_size"] == 4 and r["expert_dp_size"] == 2 for r in four)
    _check_ep2_vs_ep1(four)


@pytest.fixture(scope="module")
def skewed(models, tmp_path_factory):
    return _launch("policies_with_skewed_rows", 2, models, tmp_path_factory)


def test_replicas_with_rows_of_other_lengths_train_at_ep2_as_at_ep1(skewed):
    """Each EP=2 forward is collective over the two replicas, whose micro-batches (grouped by
    length) differ in width: the policy runs micro-batch i of both at the wider of the two
    (Policy._expert_group_widths; without it gloo aborts on a size mismatch). Padding at the end of
    causal rows, routed dropless, changes no real token's value: log-probs, losses and weights equal
    EP=1's within float32 rounding of sums in another order."""
    import torch

    ranks = skewed
    assert max(ranks[0][1]["lengths"]) > 2 * max(ranks[1][1]["lengths"])  # replica 0 long rows, 1 short ones
    for r in ranks:
        one, two = r[1], r[2]
        for key in ("logp_old", "logp_after"):
            assert float((one[key] - two[key]).abs().max()) < 2e-6, key
        for a, b in zip(one["steps"], two["steps"]):
            assert a["loss/total"] == pytest.approx(b["loss/total"], rel=1e-5, abs=1e-7)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert one["weights"].keys() == two["weights"].keys()
        worst = max(float((one["weights"][k] - two["weights"][k]).abs().max()) for k in one["weights"])
        assert worst < 1e-6, worst
    assert all(torch.equal(ranks[0][2]["weights"][k], ranks[1][2]["weights"][k]) for k in ranks[0][2]["weights"])


def test_router_metrics_equal_a_float64_reference_from_transformers(models, skewed):
    """router/z_loss, aux_loss and load_max of the first train step (both replicas' tokens that
    predict a response token, the initial weights) against transformers' router logits of the
    same rows in float64, one unpadded row at a time; at EP=1 and EP=2 alike."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from megadiv.models.families import arch_from_hf_config
    from megadiv.models.hf_config import load_hf_config
    from megadiv.policy.batches import row_lengths
    from tests.dist.token_budget import skewed_batch

    arch = arch_from_hf_config(load_hf_config(Path(models["moe"])))
    experts, k = arch.num_experts, arch.moe_router_topk
    hf = AutoModelForCausalLM.from_pretrained(models["moe"], dtype=torch.float64, experts_implementation="eager").eval()
    batch = skewed_batch()
    z = torch.zeros(arch.num_layers, dtype=torch.float64)
    prob, share = torch.zeros(arch.num_layers, experts, dtype=torch.float64), torch.zeros(arch.num_layers, experts)
    tokens = 0
    for row in range(len(batch)):
        length = int(row_lengths(batch.loss_mask[row:row + 1])[0])
        read = (batch.loss_mask[row, :length] > 0).nonzero().squeeze(-1)  # positions predicting a response token
        with torch.no_grad():
            out = hf(batch.tokens[row:row + 1, :length], output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            logits = logits.reshape(length, experts)[read]
            z[layer] += logits.logsumexp(-1).square().sum()
            prob[layer] += logits.softmax(-1).sum(0)
            share[layer] += torch.zeros(experts).index_add_(0, logits.topk(k).indices.flatten(), torch.ones(len(read) * k))
        tokens += len(read)
    share = share.double() / (tokens * k)
    expected = {"router/z_loss": float((z / tokens).mean()),
                "router/aux_loss": float((experts * (share * prob / tokens).sum(-1)).mean()),
                "router/load_max": float(experts * share.max())}
    for r in skewed:
        for ep in (1, 2):
            got = {key: r[ep]["steps"][0][key] for key in expected}
            # observed: z_loss within 6e-10 relative, aux_loss 4e-9 (float32 router inputs), the same loads
            assert got["router/z_loss"] == pytest.approx(expected["router/z_loss"], rel=1e-7), ep
            assert got["router/aux_loss"] == pytest.approx(expected["router/aux_loss"], rel=1e-7), ep
            assert got["router/load_max"] == expected["router/load_max"], ep


def _hf_log_probs(hf_dir: str, weights: dict, batch, routing=None) -> torch.Tensor:
    """transformers' float64 log-probs [B, S] of ``batch``'s response tokens with ``weights`` (HF
    names), one unpadded row at a time; with ``routing`` [B, S, layers, k] each layer's gate takes
    those experts, weighted by its softmax over them (renormalised with norm_topk_prob), instead of
    its own top k."""
    from transformers import AutoModelForCausalLM

    from megadiv.policy.batches import row_lengths
    from megadiv.rollout.embedded import fused_expert_slices

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, experts_implementation="eager").eval()
    state, fused = hf.state_dict(), fused_expert_slices(hf)
    with torch.no_grad():
        for name, t in weights.items():
            (fused[name] if name in fused else state[name]).copy_(t)
    out = torch.zeros(batch.tokens.shape, dtype=torch.float64)
    for row in range(len(batch)):
        length = int(row_lengths(batch.loss_mask[row:row + 1])[0])
        for layer, block in enumerate(hf.model.layers if routing is not None else []):
            block.mlp.gate.forward = _routed_by(block.mlp.gate, routing[row, :length, layer].long())
        with torch.no_grad():
            logp = hf(batch.tokens[row:row + 1, :length]).logits[0].log_softmax(-1)
        read = (batch.loss_mask[row, :length] > 0).nonzero().squeeze(-1)
        out[row, read] = logp[read, batch.tokens[row, read + 1]]
    return out


def _routed_by(gate, chosen: torch.Tensor):
    """A forward for transformers' Qwen3-MoE ``gate`` that takes the experts ``chosen`` [n, k]."""
    import torch.nn.functional as F

    def forward(hidden):
        logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
        top = logits.softmax(-1).gather(1, chosen)
        return logits, top / top.sum(-1, keepdim=True) if gate.norm_topk_prob else top, chosen
    return forward


def test_the_load_balancing_loss_adds_megatrons_switch_loss_gradient(models, tmp_path_factory):
    """model.moe_aux_loss_coeff = c at DP=2: the last router's gradient grows by exactly
    c sum_r T_r grad aux_r / D (each replica's micro-batch of T_r tokens, its Switch loss
    aux = E sum_e f_e P_e over them, D the step's loss tokens), against float64 from the captured
    router inputs; without it (the default) nothing is added."""
    ranks = _launch("load_balancing", 2, models, tmp_path_factory)
    weight = ranks[0][0.0]["weight"].double().requires_grad_()
    experts, topk = weight.shape[0], 2
    total = 0
    for r in ranks:
        assert torch.equal(r[0.0]["hidden"], r[0.3]["hidden"])  # the forward does not see the loss
        x = r[0.0]["hidden"].double().reshape(-1, weight.shape[1])
        assert len(x) == r["rows"] * r["width"]
        probs = (x @ weight.T).softmax(-1)
        share = torch.zeros(experts, dtype=torch.float64).index_add_(
            0, probs.topk(topk).indices.reshape(-1), torch.ones(len(x) * topk, dtype=torch.float64)) / (len(x) * topk)
        total = total + len(x) * experts * (share * probs.mean(0)).sum()
    loss_tokens = sum(r["loss_tokens"] for r in ranks)
    (expected,) = torch.autograd.grad(0.3 * total / loss_tokens, weight)
    for r in ranks:
        added = (r[0.3]["grad"] - r[0.0]["grad"]).double()
        err = float((added - expected).abs().max() / expected.abs().max())
        print("load-balancing gradient, max error relative to its largest entry:", err)
        assert err < 2e-6, err  # observed 2.5e-7 (float32 sums)


def test_routing_replay_changes_nothing_when_routing_agrees_and_replays_it_when_not(models, tmp_path_factory):
    """R2 at DP=2 x EP=2 (rows of other lengths per replica): on the recording weights a train
    step with replay equals one without, bit for bit, with agreement 1; after the routers are
    perturbed the replayed log-probs are those of transformers' model (float64) routed by the
    recorded experts, the routers' own those of transformers' own routing, the two differ, and
    router/replay_agreement falls below 1."""
    from tests.dist.token_budget import skewed_batch

    ranks = _launch("routing_replay", 2, models, tmp_path_factory)
    for r in ranks:
        plain, replayed = r["plain"], r["replayed"]
        assert (plain["routing_recorded"], replayed["routing_recorded"]) == (False, True)
        assert replayed["step"]["router/replay_agreement"] == 1.0 and "router/replay_agreement" not in plain["step"]
        assert {k: v for k, v in replayed["step"].items() if k != "router/replay_agreement"} == plain["step"]
        assert all(torch.equal(plain["weights"][k], replayed["weights"][k]) for k in plain["weights"])

        p = r["perturbed"]
        batch = skewed_batch().rows(slice(*p["rows"]))
        on = batch.loss_mask > 0
        want_replayed = _hf_log_probs(models["moe"], p["weights"], batch, p["routing"])
        want_own = _hf_log_probs(models["moe"], p["weights"], batch)
        print({"replayed": float((p["logp_replayed"].double() - want_replayed)[on].abs().max()),
               "own": float((p["logp_own"].double() - want_own)[on].abs().max()),
               "replayed vs own": float((want_replayed - want_own)[on].abs().max()),
               "agreement": p["step"]["router/replay_agreement"]})  # with -s
        assert float((p["logp_replayed"].double() - want_replayed)[on].abs().max()) < 2e-6
        assert float((p["logp_own"].double() - want_own)[on].abs().max()) < 2e-6
        assert float((want_replayed - want_own)[on].abs().max()) > 1e-2
        assert p["step"]["router/replay_agreement"] < 0.9


def test_ep2_export_and_checkpoint_reshard(two):
    assert all(r["export_exact"] for r in two)
    assert all(r["ep2_to_ep1_bitwise"] for r in two)


def test_convert_at_ep2_round_trips_bit_exactly(two):
    """megadiv convert --ep 2 on 2 ranks (each reads 1/2 of the experts), HF -> megatron -> HF."""
    assert all(r["convert_ep2_rc"] == (0, 0) and r["convert_ep2_roundtrip_exact"] for r in two)
    assert all(r["error/convert_ep"] == 2 for r in two)  # --ep 1 inside the EP=2 job: refused, in one line


def test_ep_refusals(two):
    r = two[0]
    assert r["error/ep_world"].startswith("ConfigError") and "= 1 x 4 does not divide the 2 ranks of a pipeline stage" in r["error/ep_world"]
    assert r["error/ep_experts"].startswith("ConfigError") and "does not divide the 3 experts" in r["error/ep_experts"]
    assert r["error/ep_dense"].startswith("ConfigError") and "qwen3 is dense" in r["error/ep_dense"]


def test_check_config_takes_moe_on_the_tested_paths_and_refuses_the_rest(models, tmp_path, capsys):
    """check-config (train's preflight) takes a qwen3_moe hf_dir at EP=1 and EP=2 with either
    engine, with TP x EP under sequence parallelism and with PP x EP, and refuses, by name, what
    megadiv does not train MoE with yet, layouts the model cannot take, and expert parallelism
    without experts."""
    from pathlib import Path

    from megadiv.cli import main
    from megadiv.config import ConfigError, ModelConfig, ParallelConfig, load_config
    from megadiv.trainer.config import TrainConfig

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "grpo.yaml"
    base = [str(tiny), f"run.output_dir={tmp_path}", "warm_start.make_model=none", "parallel.tensor_parallel=1"]

    def check(hf_dir: str, *overrides: str) -> tuple[int, str]:
        rc = main(["check-config", *base, f"model.hf_dir={hf_dir}", *overrides])
        return rc, capsys.readouterr().err

    assert check(models["moe"])[0] == 0
    assert check(models["moe"], "parallel.expert_parallel=2", "--world-size", "2")[0] == 0
    assert check(models["moe"], "parallel.expert_parallel=2", "--world-size", "2", "rollout.engine=sglang")[0] == 0
    assert check(models["moe"], "grpo.routing_replay=r2", "grpo.mini_batches=2")[0] == 0
    assert check(models["moe"], "grpo.routing_replay=r3", "grpo.mini_batches=1")[0] == 0  # the engine's routing
    rc, err = check(models["moe"], "grpo.routing_replay=r3", "rollout.engine=sglang")
    assert rc == 2 and "only the embedded engine returns" in err, err
    tp2 = ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]
    for layout in (tp2, ["parallel.pipeline_parallel=2"], [*tp2, "parallel.expert_tensor_parallel=1"]):
        assert check(models["moe"], *layout, "parallel.expert_parallel=2", "--world-size", "4",
                     "grpo.routing_replay=r2", "grpo.mini_batches=2")[0] == 0, layout
    # whole experts (ETP=1) split over both TP ranks of the one replica
    assert check(models["moe"], *tp2, "parallel.expert_tensor_parallel=1", "parallel.expert_parallel=2",
                 "--world-size", "2")[0] == 0
    for overrides, message in [
            ([*tp2, "parallel.expert_tensor_parallel=1", "--world-size", "2"],
             "expert_tensor_parallel=1 below tensor_parallel=2 needs expert_parallel > 1"),
            ([*tp2, "parallel.expert_tensor_parallel=1", "parallel.expert_parallel=4", "--world-size", "2"],
             "expert_tensor_parallel x parallel.expert_parallel = 1 x 4 does not divide the 2 ranks"),
            (["parallel.expert_tensor_parallel=2"], "parallel.expert_tensor_parallel=2 must divide "
                                                     "parallel.tensor_parallel=1")]:
        rc, err = check(models["moe"], *overrides)
        assert rc == 2 and message in err, (overrides, err)
    rc, err = check(models["dense"], *tp2, "parallel.expert_tensor_parallel=1", "--world-size", "2")
    assert rc == 2 and "parallel.expert_tensor_parallel=1 needs a mixture-of-experts model; qwen3 is dense" in err, err
    for overrides, message in [
            (["parallel.expert_parallel=2", "--world-size", "4", "parallel.tensor_parallel=2"],
             "parallel.tensor_parallel=2 with a mixture-of-experts model needs sequence_parallel=true"),
            (["parallel.expert_parallel=2", "--world-size", "2", "grpo.max_tokens_per_micro_batch=100"],
             "grpo.max_tokens_per_micro_batch cannot be combined with parallel.expert_parallel > 1"),
            (["grpo.pack_sequences=true", "model.transformer_impl=transformer_engine"],
             "grpo.pack_sequences=true with a mixture-of-experts model (qwen3_moe): its micro-batches run padded"),
            (["model.fp8=tensorwise"], "model.fp8=tensorwise with a mixture-of-experts model (qwen3_moe) is not")]:
        rc, err = check(models["moe"], *overrides)
        assert rc == 2 and message in err, (overrides, err)
    assert check(models["moe"], "model.moe_aux_loss_coeff=0.001")[0] == 0
    rc, err = check(models["dense"], "model.moe_aux_loss_coeff=0.001")
    assert rc == 2 and "weights a mixture-of-experts model's load-balancing loss" in err, err
    rc, err = check(models["dense"], "grpo.routing_replay=r2", "grpo.mini_batches=2")
    assert rc == 2 and "grpo.routing_replay=r2 needs a mixture-of-experts model" in err, err
    for overrides, message in [(["grpo.mini_batches=1"], "with grpo.ppo_epochs x grpo.mini_batches = 1 there are none"),
                               (["model.recompute_granularity=selective"],
                                "cannot be combined with model.recompute_granularity=selective")]:
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, tiny, [f"run.output_dir={tmp_path}", f"model.hf_dir={models['moe']}",
                                            "warm_start.make_model=none", "grpo.routing_replay=r2", *overrides])
    rc, err = check(models["moe3"], "parallel.expert_parallel=2", "--world-size", "2")
    assert rc == 2 and "parallel.expert_parallel=2 does not divide the 3 experts" in err, err
    rc, err = check(models["dense"], "parallel.expert_parallel=2", "--world-size", "2")
    assert rc == 2 and "parallel.expert_parallel=2 needs a mixture-of-experts model; qwen3 is dense" in err, err
    for override in ("parallel.expert_parallel=2", "parallel.expert_tensor_parallel=1"):
        with pytest.raises(ConfigError, match=f"{override} needs a mixture-of-experts model, and "
                                              f"warm_start.make_model makes dense ones"):
            load_config(TrainConfig, tiny, [f"run.output_dir={tmp_path}", override])
    with pytest.raises(ConfigError, match="parallel.expert_parallel=2 applies to model.backend=megatron only"):
        TrainConfig(model=ModelConfig(hf_dir=models["dense"], backend="deepspeed"),
                    parallel=ParallelConfig(expert_parallel=2))


@pytest.mark.parametrize("name", ["moe", "shared"])
def test_the_embedded_engine_returns_the_routing_it_generated_with(models, name):
    """SamplingParams.return_routing: each completion's routing (R3) is, position by position, the
    experts transformers' routers choose in one plain forward of prompt + response (the engine
    ran the prompts left-padded, the prefill once per prompt for its n samples, then one token at
    a time)."""
    from megadiv.rollout.embedded import EmbeddedEngine, RoutedExperts
    from megadiv.rollout.engine import SamplingParams

    engine = EmbeddedEngine(models[name])
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    for n in (1, 3):
        groups = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=6, return_routing=True), seed=n)
        for prompt, group in zip(prompts, groups):
            for c in group:
                with RoutedExperts(engine.model) as plain, torch.no_grad():
                    engine.model(torch.tensor([prompt + c.token_ids]))
                expected = plain.columns(1)[0, :-1]  # the last token's routing: no position needs it
                assert c.routing.shape == expected.shape == (len(prompt) + len(c.token_ids) - 1, 2, 2)
                assert torch.equal(c.routing.sort(-1).values, expected.sort(-1).values), (n, prompt)
    assert engine.generate(prompts, SamplingParams(max_new_tokens=2))[0][0].routing is None


def test_the_embedded_engine_takes_expert_tensors_by_their_checkpoint_names(models, tmp_path):
    """transformers keeps the experts fused ([E, 2F, H] and [E, H, F]); the trainer sends them
    per expert under the checkpoint's names: each lands in its slice, and the engine then scores
    exactly like transformers' own loading of a checkpoint holding those tensors."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from megadiv.rollout.embedded import EmbeddedEngine
    from megadiv.rollout.engine import WeightSyncError

    engine = EmbeddedEngine(models["moe"])
    weights = load_file(f"{models['moe']}/model.safetensors")
    experts = [k for k in weights if ".mlp.experts." in k]
    assert len(experts) == 2 * 8 * 3 and not set(experts) & set(engine._params)  # fused in memory
    generator = torch.Generator().manual_seed(0)
    changed = {k: torch.randn(v.shape, generator=generator) * 0.1 for k, v in weights.items()}
    assert engine.update_weights([list(changed.items())], "v1").num_tensors == len(weights)
    reference_dir = shutil.copytree(models["moe"], tmp_path / "changed")
    save_file(changed, reference_dir / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    prompts, responses = [[3, 4, 5, 6], [7, 8]], [[9, 10, 11], [4, 4]]
    for prompt, response, got in zip(prompts, responses, engine.score(prompts, responses)):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt + response])).logits.float()
        expected = torch.log_softmax(logits, -1)[0, len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)  # batched (padded) against one row
    with pytest.raises(WeightSyncError, match="has shape"):
        engine.update_weights([[(experts[0], torch.zeros(3, 3))]], "v2")
    engine.shutdown()


@pytest.mark.slow  # five launches of megadiv train on 2 cores (about 2 minutes)
def test_megadiv_train_runs_a_moe_model_end_to_end_and_resumes_at_another_ep(models, tmp_path):
    """``megadiv train`` of the tiny Qwen3-MoE: warm start, GRPO steps, evaluation, checkpoints
    and export, at EP=1 on one rank with R2 routing replay (the engine shares the dense weights,
    copies the experts), with R3 (the engine's routing: the trainer's own agrees with it)
    and at DP=2 x EP=2 (each rank exports every expert, gathered over EP). The probe after every
    sync checks that the engine scores with the trainer's weights. A run stopped at step 2 at
    EP=2 resumes at EP=1 (the expert shards re-dealt) and ends where the uninterrupted EP=2 run
    does, within the sums-in-another-order differences of EP (float32)."""
    import shutil

    import torch

    from tests.test_trainer import hf_weights, megadiv_train, step_records

    moe = [f"model.hf_dir={models['moe']}", "warm_start.make_model=none", "eval.every=0", "parallel.tensor_parallel=1",
           "grpo.micro_batch_size=4"]
    one = tmp_path / "one"  # with R2 routing replay (the config takes two mini-batches per step)
    megadiv_train(one, *moe, "grpo.steps=2", "checkpoint.every=0", "grpo.routing_replay=r2", nproc=1)
    assert all(0 < r["router/replay_agreement"] <= 1 for r in step_records(one))
    # R3, one update per batch: the engine's routing replayed, on the weights that generated the rows
    engine_routed = tmp_path / "r3"
    megadiv_train(engine_routed, *moe, "grpo.steps=2", "checkpoint.every=0", "grpo.routing_replay=r3",
                  "grpo.mini_batches=1", nproc=1)
    assert all(r["router/replay_agreement"] >= 0.99 and r["skipped"] == 0 for r in step_records(engine_routed))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    out = megadiv_train(straight, *moe, "grpo.steps=3", "parallel.expert_parallel=2")
    megadiv_train(resumed, *moe, "grpo.steps=3", "parallel.expert_parallel=2", "grpo.stop_after=2")
    same = shutil.copytree(resumed, tmp_path / "same")  # the same checkpoint, resumed at EP=2
    out_resumed = megadiv_train(resumed, *moe, "grpo.steps=3", "parallel.expert_parallel=1")
    out_same = megadiv_train(same, *moe, "grpo.steps=3", "parallel.expert_parallel=2")
    assert "resumed from" in out_resumed and "resumed from" in out_same and "step 3/3 | " in out
    a, c = step_records(straight), step_records(same)
    assert [(r["loss/total"], r["grad_norm"]) for r in a] == [(r["loss/total"], r["grad_norm"]) for r in c]
    wa, wc = hf_weights(straight), hf_weights(same)
    assert all(torch.equal(wa[k], wc[k]) for k in wa)  # at the same layout, bit for bit
    for run in (one, straight, resumed):
        steps = step_records(run)
        assert all(r["skipped"] == 0 and r["sync/probe_abs_diff_mean"] < 1e-5 for r in steps), steps
        assert all(r["router/load_max"] >= 1 and r["router/z_loss"] > 0 for r in steps), steps
        summary = json.loads((run / "summary.json").read_text())
        assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
        weights = hf_weights(run)
        assert sum(".mlp.experts." in k for k in weights) == 2 * 8 * 3
    a, b = step_records(straight), step_records(resumed)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "response/length_mean"):
            assert ra[key] == rb[key], (ra["step"], key)
        assert rb["loss/total"] == pytest.approx(ra["loss/total"], rel=1e-5, abs=1e-7), ra["step"]
    wb = hf_weights(resumed)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < 1e-6, worst


@pytest.mark.slow  # 4 ranks, about 4 minutes on 2 cores
def test_megadiv_train_runs_tp_x_ep_with_engine_routing_and_a_load_balancing_loss(models, tmp_path):
    """``megadiv train`` of the tiny Qwen2-MoE (shared expert) at TP=2 x EP=2 with sequence
    parallelism on 4 ranks, R3 (the embedded engine's routing replayed) and the load-balancing
    loss on: the trainer routes as the engine did, the engine scores with the trainer's weights
    after each sync; stopped after step 1, resumed with whole experts (expert_tensor_parallel=1)
    for step 2, and resumed at TP = EP = 1 on 2 ranks for step 3: each checkpoint (weights and
    optimizer state) re-dealt to the next layout."""
    from tests.test_trainer import megadiv_train, step_records

    run = tmp_path / "tp2-ep2"
    common = [f"model.hf_dir={models['shared']}", "warm_start.make_model=none", "eval.every=0", "grpo.steps=3",
              "grpo.micro_batch_size=4", "grpo.routing_replay=r3", "model.moe_aux_loss_coeff=0.001"]
    tp2_ep2 = ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "parallel.expert_parallel=2"]
    megadiv_train(run, *common, *tp2_ep2, "grpo.stop_after=1", nproc=4)
    out = megadiv_train(run, *common, *tp2_ep2, "parallel.expert_tensor_parallel=1", "grpo.stop_after=2", nproc=4)
    assert "resumed from" in out and "step 2/3 | " in out
    out = megadiv_train(run, *common, "parallel.tensor_parallel=1", "parallel.expert_parallel=1", nproc=2)
    assert "resumed from" in out and "step 3/3 | " in out
    steps = step_records(run)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["skipped"] == 0 and r["router/replay_agreement"] >= 0.99 for r in steps), steps
    assert all(r["sync/probe_abs_diff_mean"] < 1e-5 for r in steps if "sync/probe_abs_diff_mean" in r), steps


@pytest.mark.slow
@pytest.mark.sglang
def test_megadiv_train_pushes_a_moe_model_to_an_sglang_server_at_ep2(models, tmp_path):
    """SGLang's CPU server serves qwen3_moe (its native-torch MoE path): at DP=2 x EP=2 the actor
    exports every expert (gathered over EP) and pushes them by broadcast; after each push the
    server's log-probs of the probe equal the trainer's, and the log-probs it sampled with equal
    the trainer's of the same tokens (float32 on both sides)."""
    from tests.test_trainer import megadiv_train, step_records

    run = tmp_path / "sglang"
    megadiv_train(run, f"model.hf_dir={models['moe']}", "warm_start.make_model=none", "parallel.tensor_parallel=1",
                  "parallel.expert_parallel=2", "rollout.engine=sglang", "rollout.sync_method=distributed",
                  "grpo.steps=2", "grpo.micro_batch_size=4", "eval.every=0", "eval.data.max_items=8",
                  "checkpoint.every=0", timeout_s=1200)
    steps = step_records(run)
    assert [r["step"] for r in steps] == [1, 2]
    print({k: [r[k] for r in steps] for k in ("sync/probe_abs_diff_max", "mismatch/abs_log_ratio_max")})  # with -s
    for r in steps:
        assert r["sync/probe_abs_diff_max"] < 1e-5 and r["mismatch/abs_log_ratio_max"] < 1e-5, r
        assert r["sync/bytes_sent"] > 0 and r["skipped"] == 0


def test_make_tiny_model_verb_writes_a_qwen3_moe(tmp_path, capsys):
    import json

    from transformers import AutoModelForCausalLM

    from megadiv.cli import main

    out = tmp_path / "moe"
    assert main(["make-tiny-model", "--family", "qwen3_moe", "--out", str(out), "--experts", "6",
                 "--experts-per-token", "3", "--ffn", "24", "--hidden", "32"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 5 writes the latter
    assert (experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["norm_topk_prob"]) == (6, 3, 24, True)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.model.layers[0].mlp.gate.weight.abs().min() > 0  # a random router, not HF's zeros
    assert main(["make-tiny-model", "--family", "qwen3_moe", "--out", str(tmp_path / "bad"), "--experts", "2",
                 "--experts-per-token", "3"]) == 2
    assert "--experts-per-token 3 must be in 1..--experts 2" in capsys.readouterr().err


def test_pp2_logits_and_export(two):
    last = [r for r in two if "pp2_logit_diff" in r]
    assert len(last) == 1 and last[0]["pp2_logit_diff"] <= LOGIT_TOL, last
    assert all(r["pp2_export_exact"] for r in two)


@pytest.mark.slow  # a 4-rank launch on 2 cores
def test_layouts_with_experts_train_as_ep1(models, tmp_path_factory):
    """EP=2 (DP=2 x EP=2), EP=4, TP=2 x EP=2 with sequence parallelism and PP=2 x EP=2 (4 ranks)
    against EP=1 at DP=4 (the Qwen3-MoE; the Qwen2-MoE at TP=2 x EP=2), in float64: the trainer's
    Policy with routing replay on the same 8 rows: old log-probs, the two steps' losses, router
    metrics and grad norms, and each step's gradients (the second routed by the routing recorded
    before the first step, which moved the routers: replay_agreement < 1). PP=2 x EP=2 replays
    EP=1's recording of all layers, each stage its own (R3's path: the engine's routing comes with
    the batch). Observed: log-probs within 1.8e-15, losses and router metrics within 2.4e-16
    relative, every gradient within 3.8e-15 of its tensor's largest entry at either step (sums in
    another order); megatron computes the grad norm in float32 (clip_grads.get_grad_norm_fp32:
    5.5e-8 relative)."""
    ranks = _launch("layouts", 4, models, tmp_path_factory)
    logp = {}  # layout -> {row: log-probs}, from the ranks that hold them (the last stage)
    for r in ranks:
        for name, run in r.items():
            if name not in LAYOUTS:
                continue
            if run["logp_old"] is not None:
                for i, row in zip(range(*run["rows"]), run["logp_old"]):
                    logp.setdefault(name, {})[i] = row
    layouts = (("ep2", "ep1"), ("ep4", "ep1"), ("tp2-ep2", "ep1"), ("pp2-ep2", "ep1"), ("tp2-etp1-ep2", "ep1"),
               ("tp2-etp1-ep4", "ep1"), ("shared-tp2-ep2", "shared-ep1"))
    for name, reference in layouts:
        ep1 = ranks[0][reference]
        assert sorted(logp[name]) == list(range(8)), name
        assert all(row.dtype == torch.float64 for row in logp[name].values())
        assert max(float((logp[name][i] - logp[reference][i]).abs().max()) for i in range(8)) < 1e-14, name
        for r in ranks:
            run = r[name]
            for a, b in zip(run["steps"], ep1["steps"]):
                for key in ("loss/total", "router/z_loss", "router/aux_loss", "router/load_max",
                            "router/replay_agreement"):
                    assert a[key] == pytest.approx(b[key], rel=2e-15, abs=1e-15), (name, key)
                assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=3e-7), name  # float32 in megatron
            for step, (grads, ref) in enumerate(zip(run["grads"], ep1["grads"])):
                assert grads.keys() == ref.keys()
                rel = {k: float((grads[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref}
                worst = max(rel, key=rel.get)
                assert rel[worst] < 2e-14, (name, step, worst, rel[worst])
    for ep1 in (ranks[0]["ep1"], ranks[0]["shared-ep1"]):
        assert ep1["steps"][0]["router/replay_agreement"] == 1.0 > ep1["steps"][1]["router/replay_agreement"]
    for r in ranks:  # the TP=2 x ETP=1 x EP=2 checkpoint loaded at TP = EP = 1: the same weights, bit for bit
        saved, loaded = r["etp1-ckpt"]["saved"], r["etp1-ckpt"]["loaded"]
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
