"""Trainer pieces: packing rows, shaping, dynamic sampling, and the Policy's layout independence."""
from __future__ import annotations

import json

import pytest
import torch

from megadiv.divergence import AdvantageConfig
from megadiv.policy.batches import SequenceBatch
from megadiv.rollout import Completion
from megadiv.trainer.experience import build_experience, informative, overlong_shaping
from tests.torchrun import run_torchrun


def test_pack_puts_the_mask_on_positions_that_predict_response_tokens():
    b = SequenceBatch.pack([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0, response_values=[[-.1, -.2], [-.3, -.4, -.5]])
    assert b.tokens.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    # position t predicts token t + 1: the last prompt token's position predicts the first response token
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert b.logp_rollout[0, 2:4].tolist() == pytest.approx([-.1, -.2])
    assert b.logp_rollout[1, 0:3].tolist() == pytest.approx([-.3, -.4, -.5])
    assert len(b.micro_batches(1)) == 2 and b.rows(slice(1, 2)).tokens.tolist() == [[8, 3, 4, 9, 0]]


def test_overlong_shaping_is_dapos_linear_ramp():
    lengths = torch.tensor([10, 12, 14, 16])
    assert overlong_shaping(lengths, 16, 4, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert overlong_shaping(lengths, 16, 0, 1.0).tolist() == [0.0] * 4


def _completions(rewards_per_group):
    return [[Completion([1] * (i + 1), [-0.5] * (i + 1), "stop", "v") for i, _ in enumerate(g)]
            for g in rewards_per_group]


def test_experience_advantages_and_dynamic_sampling():
    rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
    exp = build_experience([[7], [8], [9], [10]], _completions(rewards), sum(rewards, []),
                           ["correct" if r else "wrong" for r in sum(rewards, [])],
                           AdvantageConfig(estimator="grpo", group_size=2), max_new_tokens=8)
    assert exp.prompts == [[7], [7], [8], [8], [9], [9], [10], [10]]
    assert exp.metrics["reward/uniform_groups"] == 0.5 and exp.metrics["reward/reason_correct"] == 0.5
    assert exp.advantages[2:6].abs().max() == 0  # equal rewards: no signal
    assert [informative(r, g, max_new_tokens=8) for r, g in zip(rewards, _completions(rewards))] == [
        True, False, False, True]
    # equal scores, but overlong shaping tells the lengths 1 and 2 apart (buffer 7 of 8 tokens)
    assert informative([1.0, 1.0], _completions([[1.0, 1.0]])[0], max_new_tokens=8, overlong_buffer=7)


def test_mask_truncated_drops_cut_completions_from_the_loss_only():
    groups = [[Completion([1, 2], [-0.5] * 2, "length", "v"), Completion([3], [-0.5], "stop", "v")],
              [Completion([4], [-0.5], "stop", "v"), Completion([5, 6], [-0.5] * 2, "length", "v")]]
    args = ([[7], [8]], groups, [1.0, 0.0, 1.0, 0.0], ["correct", "wrong", "correct", "wrong"],
            AdvantageConfig(estimator="dr_grpo", group_size=2), 2)
    kept, masked = build_experience(*args), build_experience(*args, mask_truncated=True)
    assert masked.advantages.tolist() == kept.advantages.tolist() == [0.5, -0.5, 0.5, -0.5]  # baseline unchanged
    assert masked.in_loss.tolist() == [0.0, 1.0, 1.0, 0.0] and kept.in_loss.tolist() == [1.0] * 4
    assert masked.metrics["response/truncated_frac"] == 0.5
    full, cut = kept.to_batch(pad_id=0).loss_mask, masked.to_batch(pad_id=0).loss_mask
    assert full.sum(-1).tolist() == [2, 1, 1, 2] and cut.sum(-1).tolist() == [0, 1, 1, 0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megadiv.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", tokenizer="bpe", vocab=301,
                               hidden=64, heads=4, kv_heads=2, ffn=128, layers=3))


# (loss aggregation, optimizer, full-vocabulary regulariser): SGD shows the gradient itself in the
# weights; Adam at DP > 1 runs megatron's distributed optimizer (ZeRO-1 over DP).
SGD, ADAM, REGULARIZED = ("token-mean", "sgd", None), ("seq-mean-token-mean", "adam", None), \
    ("token-mean", "sgd", "full_prob_l2")
# optim.distributed_optimizer=true: megatron's distributed optimizer at DP=1 too (TP=1 run only)
ADAM_DISTRIBUTED = ("seq-mean-token-mean", "adam_distributed", None)
# name -> (TP, PP, ranks, extra args). DP = ranks / (TP x PP); each replica trains its own rows of
# the same global batch. Recompute and an explicit uneven stage split ride along: they must not
# change the maths either.
LAYOUTS = {
    "tp1": (1, 1, 1, {"threads": 1}),
    # 512 rows (4 micro-batches of 128): matmuls large enough for torch to split over the threads
    "tp1-wide": (1, 1, 1, {"threads": 1, "rows": 512}),
    "tp1-wide-2threads": (1, 1, 1, {"threads": 2, "rows": 512}),
    "tp2": (2, 1, 2, {}),
    "pp2": (1, 2, 2, {"stage_layers": [2, 1]}),
    "dp2": (1, 1, 2, {"model": {"recompute_granularity": "selective"}}),
    "tp2dp2": (2, 1, 4, {"model": {"recompute_granularity": "full", "recompute_method": "uniform",
                                   "recompute_num_layers": 1}}),
    # the interleaved schedule (VPP): 2 chunks of 1 layer per stage, so a 4-layer model and its TP=1 reference
    "tp1-4layers": (1, 1, 1, {"threads": 1, "layers": 4}),
    "pp2vpp2": (1, 2, 2, {"virtual_pipeline": 2, "layers": 4}),
}


# TP=2 x DP=2 is a 4-rank launch (~75 s on 2 cores): make test-all runs it; make test the 1- and 2-rank layouts
FOUR_RANKS = pytest.mark.slow


class LayoutRuns(dict):
    """{layout: per-rank results}: one torchrun launch per layout, every run inside it, made when a
    test first asks for the layout (so that make test never launches the slow ones)."""

    def __init__(self, hf_dir: str, folder):
        super().__init__()
        self.hf_dir, self.folder = hf_dir, folder

    def _model(self, layers: int | None) -> str:
        """The tiny model, or the same with ``layers`` layers (made once, in ``folder``)."""
        if layers is None:
            return self.hf_dir
        from megadiv.models.tiny import make_tiny_model

        path = self.folder / f"qwen2-{layers}layers"
        if not path.exists():
            make_tiny_model(path, "qwen2", tokenizer="bpe", vocab=301, hidden=64, heads=4, kv_heads=2, ffn=128,
                            layers=layers)
        return str(path)

    def __missing__(self, name: str):
        tp, pp, nproc, extra = LAYOUTS[name]
        extra = dict(extra)
        hf_dir = self._model(extra.pop("layers", None))
        self[name] = run_torchrun("tests.dist.trainer_policy:policy_steps", nproc, timeout_s=600,
                                  args={"tp": tp, "pp": pp, "hf_dir": hf_dir, **extra,
                                        "runs": ([ADAM] if "rows" in extra
                                                 else [SGD, ADAM] + ([REGULARIZED] if pp == 1 else []))
                                                + ([ADAM_DISTRIBUTED] if name == "tp1" else [])})
        return self[name]


@pytest.fixture(scope="module")
def layout_runs(tiny_model, tmp_path_factory):
    return LayoutRuns(tiny_model, tmp_path_factory.mktemp("layouts"))


# Tolerances (float32 weights, float64 metric reductions): the layouts sum the same terms in other
# orders (TP all-reduces, DP gradient reduce-scatter, micro-batch accumulation), and three steps
# (SGD at lr 0.5) carry that rounding on; gloo's reductions are deterministic, so each layout gives
# the same figures every run on one machine (another CPU may round otherwise). Observed against TP=1 x DP=1: losses, KL and grad norms <= 3e-6
# relative; weights after three SGD steps <= 1.4e-6 absolute (weights ~0.02-1), after three Adam
# steps <= 1.7e-7 (Adam's eps is 1e-5 here, see tests/dist/trainer_policy.py: at the default 1e-8
# a near-zero gradient element's rounding decides its update, observed 1.5e-5 at TP=2).
METRIC_TOL = dict(rel=1e-5, abs=1e-6)
WEIGHT_TOL = {"sgd": dict(rtol=0, atol=3e-6), "adam": dict(rtol=0, atol=1e-6)}


def _assert_same_training(run, ref, name, keys, optimizer, weight_tol=None):
    for s, s_ref in zip(run["steps"], ref["steps"], strict=True):
        for key in keys:
            assert s[key] == pytest.approx(s_ref[key], **METRIC_TOL), (name, key, s[key], s_ref[key])
    assert run["weights"].keys() == ref["weights"].keys()
    for k, w in run["weights"].items():
        torch.testing.assert_close(w, ref["weights"][k], **(weight_tol or WEIGHT_TOL[optimizer]), msg=lambda m, k=k: f"{name} {k}: {m}")
    assert run["logp_sum"] == pytest.approx(ref["logp_sum"], rel=5e-6), name  # observed <= 1.2e-6


@pytest.mark.parametrize("run", [SGD, ADAM], ids=["sgd-token-mean", "adam-seq-mean-token-mean"])
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", pytest.param("tp2dp2", marks=FOUR_RANKS)])
def test_policy_steps_do_not_depend_on_the_layout(layout_runs, layout, run):
    """TP=2, PP=2, DP=2 (TP=1) and TP=2 x DP=2 each train like TP=1 x DP=1 on the same global batch:
    the same losses, gradient norms, metrics and weights after three steps (per-token loss scaling
    over micro-batches and DP replicas, grad norms that count each TP shard once, see builder.py,
    metrics reduced over stages and replicas, Adam sharded over DP). A NaN step is skipped on every
    rank without touching the weights."""
    ref = layout_runs["tp1"][0][run]
    assert ref["steps"][-1]["loss/total"] != ref["steps"][0]["loss/total"]  # it learns
    tp, pp, nproc, _ = LAYOUTS[layout]
    assert all(r["dp_size"] == nproc // (tp * pp) for r in layout_runs[layout])
    for rank, r in enumerate(layout_runs[layout]):
        assert r[run]["skipped"] == 1.0 and r[run]["unchanged"]
        _assert_same_training(r[run], ref, f"{layout} rank {rank}",
                              ("loss/total", "loss/kl", "grad_norm", "entropy", "clip/frac_low", "clip/frac_high",
                               "ratio/max", "ratio/min", "ref/k3"), optimizer=run[1])


def test_plain_and_distributed_adam_make_the_same_update_at_dp1(layout_runs):
    """At DP=1 megatron's DistributedOptimizer (optim.distributed_optimizer=true) owns the whole
    state: it must give the same steps and weights as the plain optimizer, Adam's default there. Observed on this CPU:
    weights, losses and log-probs identical (0.0), the third step's grad norm 1.8e-8 apart (its
    reduction order); the tolerances are the layouts' float32 ones."""
    (result,) = layout_runs["tp1"]
    plain, distributed = result[ADAM], result[ADAM_DISTRIBUTED]
    assert (plain["optimizer"], distributed["optimizer"]) == ("FP32Optimizer", "DistributedOptimizer")
    _assert_same_training(plain, distributed, "plain vs distributed Adam",
                          ["loss/total", "grad_norm", "entropy"], "adam")
    assert distributed["skipped"] == 1.0 and distributed["unchanged"]


def test_policy_steps_do_not_depend_on_the_threads(layout_runs):
    """Two intra-op threads (the threads-per-rank rule gives a lone rank every core) train like one
    on a 512-row batch, where torch splits the matmuls and reductions over the threads: only the
    summation order may change, so the layouts' float32 tolerances hold (megadiv/parallel/threads.py;
    observed: weights 7.3e-8 apart after three steps, entropy 2.2e-8 relative, so the threads do
    split the work). Adam only, with its default optimizer (the plain one at DP=1: the fast path of
    docs/performance.md, Threads): SGD at the layouts' lr 0.5 diverges on this batch (grad norm 4.5 -> 1e5 -> NaN)."""
    run = ADAM
    (one,), (two,) = layout_runs["tp1-wide"], layout_runs["tp1-wide-2threads"]
    assert (one[run]["threads"], two[run]["threads"]) == (1, 2)
    _assert_same_training(two[run], one[run], "2 threads", ("loss/total", "loss/kl", "grad_norm", "entropy",
                                                              "ratio/max", "ratio/min", "ref/k3"), optimizer=run[1])


@pytest.mark.parametrize("layouts", [["tp1", "tp2", "pp2", "dp2"], pytest.param(["tp2dp2"], marks=FOUR_RANKS)],
                         ids=["up-to-2-ranks", "tp2dp2"])
def test_the_layouts_are_what_they_claim(layout_runs, layouts):
    """Adam runs megatron's distributed optimizer at DP > 1 (sharded over DP) and its plain one at
    DP=1, SGD the plain one; the uneven stage split and the recompute settings reach megatron."""
    everywhere = [r for name in layouts for r in layout_runs[name]]
    for r in everywhere:
        assert r[ADAM]["optimizer"] == ("DistributedOptimizer" if r["dp_size"] > 1 else "FP32Optimizer"), r["dp_size"]
    assert {r[SGD]["optimizer"] for r in everywhere} == {"FP32Optimizer"}
    recompute = {"tp1": (None, None, None), "dp2": ("selective", None, None), "tp2dp2": ("full", "uniform", 1)}
    for name in layouts:
        if name == "pp2":
            assert [r[SGD]["layers_here"] for r in layout_runs[name]] == [2, 1]
        if name in recompute:
            assert {r[SGD]["recompute"] for r in layout_runs[name]} == {recompute[name]}, name


def test_interleaved_schedule_batches_split_into_a_multiple_of_pp():
    """megatron's interleaved schedule runs micro-batches in groups of PP and refuses fewer than PP
    (schedules.py, forward_backward_pipelining_with_interleaving): the policy regroups each batch's
    rows into the largest micro-batches that give a multiple of PP, and the config refuses a batch
    that has none, naming it."""
    from megadiv.config import ConfigError, ModelConfig, ParallelConfig
    from megadiv.policy.megatron import interleaved_rows
    from megadiv.rollout import RolloutConfig
    from megadiv.trainer.config import GRPOConfig, TrainConfig, WarmStartConfig

    assert interleaved_rows(8, 2, 2) == 2            # 4 micro-batches: as asked
    assert interleaved_rows(8, 8, 2) == 4            # one asked (the probe's call): two
    assert interleaved_rows(12, 4, 4) == 3 and interleaved_rows(6, 6, 3) == 2
    with pytest.raises(ConfigError, match="3 rows do not split into a multiple of parallel.pipeline_parallel=2"):
        interleaved_rows(3, 3, 2)

    def cfg(probe_prompts=4, micro_batch_size=2, world_size=2):
        c = TrainConfig(model=ModelConfig(hf_dir="/nonexistent"), warm_start=WarmStartConfig(make_model="qwen2"),
                        parallel=ParallelConfig(pipeline_parallel=2, virtual_pipeline=2),
                        rollout=RolloutConfig(probe_prompts=probe_prompts),
                        grpo=GRPOConfig(prompts_per_step=1, micro_batch_size=micro_batch_size))
        return c.check_world_size(world_size)

    assert cfg() == 1                                 # 8 rollout rows, 4 micro-batches of 2
    with pytest.raises(ConfigError, match="rollout.probe_prompts: 3 rows"):
        cfg(probe_prompts=3)
    with pytest.raises(ConfigError, match=r"a mini-batch \(1 // grpo.mini_batches=1 rows per replica\): 1 rows"):
        cfg(micro_batch_size=1, world_size=16)        # 8 replicas of 1 row


@pytest.mark.parametrize("run", [SGD, ADAM], ids=["sgd-token-mean", "adam-seq-mean-token-mean"])
def test_interleaved_pipeline_trains_like_tp1(layout_runs, run):
    """PP=2 with two model chunks per stage (parallel.virtual_pipeline=2, megatron's interleaved
    1F1B, which takes one data iterator per chunk) trains a 4-layer model like TP=1 x PP=1: the
    layouts' tolerances. A log-prob call asking for one micro-batch (the post-sync probe's) is
    regrouped into two, one per stage, and gives the same log-probs. Weights after three SGD steps:
    observed 6.7e-6 from TP=1 on 12 of the tied embedding's 19,264 elements, exactly what PP=2
    without interleaving gives on this model (its two stages sum the tied embedding's gradient in
    another order); a chunk fed the wrong micro-batch, the failure this guards, moved the first
    loss by 0.1."""
    ref = layout_runs["tp1-4layers"][0][run]
    assert ref["steps"][-1]["loss/total"] != ref["steps"][0]["loss/total"]  # it learns
    for rank, r in enumerate(layout_runs["pp2vpp2"]):
        assert r[run]["chunks"] == 2 and r[run]["layers_here"] == 1
        assert r[run]["skipped"] == 1.0 and r[run]["unchanged"]
        _assert_same_training(r[run], ref, f"pp2vpp2 rank {rank}", ("loss/total", "loss/kl", "grad_norm", "entropy",
                                                                   "ratio/max", "ratio/min", "ref/k3"), optimizer=run[1],
                              weight_tol=dict(rtol=0, atol=1e-5))
        assert r[run]["logp_sum_one_micro_batch"] == pytest.approx(r[run]["logp_sum"], rel=1e-6)


@pytest.mark.parametrize("layout", ["tp2", "dp2", pytest.param("tp2dp2", marks=FOUR_RANKS)])
def test_full_vocabulary_regularizer_in_training_does_not_depend_on_the_layout(layout_runs, layout):
    """A full-vocabulary ProbL2 regulariser on the actor's and the reference's logit shards (the
    reference logits recomputed per micro-batch and consumed) trains exactly like at TP=1 x DP=1."""
    ref = layout_runs["tp1"][0][REGULARIZED]
    assert ref["steps"][-1]["loss/regularizer"] > 0
    for rank, r in enumerate(layout_runs[layout]):
        _assert_same_training(r[REGULARIZED], ref, f"{layout} rank {rank}",
                              ("loss/total", "loss/regularizer", "grad_norm", "entropy"), optimizer="sgd")


@pytest.mark.slow
def test_a_dp2_checkpoint_written_by_both_ranks_resumes_at_dp1_dp4_and_tp2(tiny_model, tmp_path):
    """Adam with the distributed optimizer at TP=1 x DP=2: two steps, a checkpoint written in the
    background while the third step trains. Both ranks write shards (megatron's fully parallel
    save), each rank's writer hashes its own files, and the sealed checkpoint verifies. Loaded by
    fresh actors at DP=1 (the plain optimizer, Adam's default there: the state converted), at DP=4 (ranks 2 and 3 have no saved RNG state: theirs is derived from
    their coordinates) and at TP=2, it continues with the same third step: loss, grad norm, LR and
    weights equal the uninterrupted run to float32 reduction-order error (the optimizer state in
    the checkpoint is model-space, 'fully_reshardable')."""
    from megadiv.trainer.checkpoint import CHECKSUM, MANIFEST, checkpoint_problem, file_checksum

    run_dir = tmp_path / "run"
    straight = run_torchrun("tests.dist.trainer_checkpoint:save_then_continue", 2, timeout_s=600,
                            args={"tp": 1, "hf_dir": tiny_model, "run_dir": str(run_dir)})
    assert {r["optimizer"] for r in straight} == {"DistributedOptimizer"}
    ref = straight[0]
    step, figures = ref["sealed"]
    assert step == 2 and figures.keys() == {"checkpoint/blocking_s", "checkpoint/write_s", "checkpoint/total_s"}
    assert 0 < figures["checkpoint/blocking_s"] <= figures["checkpoint/total_s"]
    assert 0 < figures["checkpoint/write_s"] <= figures["checkpoint/total_s"]
    ckpt = run_dir / "checkpoints" / "step_000002"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    shards = {r: sorted(n for n in manifest["files"] if n.startswith(f"__{r}_")) for r in (0, 1)}
    print("shards per rank:", shards)
    assert all(shards.values()), shards  # both ranks wrote shards
    assert manifest["ranks"] == [[0, 0, 0], [0, 0, 1]]
    assert not list(ckpt.glob("written_*")) and checkpoint_problem(ckpt) is None
    assert all(manifest[CHECKSUM][n] == file_checksum(ckpt / n) for n in manifest["files"])
    for tp, nproc in ((1, 1), (1, 4), (2, 2)):
        resumed = run_torchrun("tests.dist.trainer_checkpoint:resume_and_step", nproc, timeout_s=600,
                               args={"tp": tp, "hf_dir": tiny_model, "run_dir": str(run_dir)})
        # the ranks at a saved rank's coordinates continue its RNG streams; the others derive theirs
        saved = {(0, 0, 0): straight[0]["draws"], (0, 0, 1): straight[1]["draws"]}
        for r in resumed:
            assert r["draws"] == saved.get(tuple(r["coordinates"]), r["draws"]), (tp, nproc, r["coordinates"])
        derived = [tuple(r["draws"]) for r in resumed if tuple(r["coordinates"]) not in saved]
        assert len(derived) == {(1, 1): 0, (1, 4): 2, (2, 2): 1}[tp, nproc]
        assert len(set(derived)) == len(derived) and not set(derived) & {tuple(d) for d in saved.values()}
        for r in resumed:
            assert r["state"] == {"step": 2} and r["dp_size"] == nproc // tp
            assert r["third"]["lr"] == ref["third"]["lr"]
            for key in ("loss/total", "grad_norm", "entropy"):
                assert r["third"][key] == pytest.approx(ref["third"][key], **METRIC_TOL), (tp, nproc, key)
            for k, w in r["weights"].items():
                torch.testing.assert_close(w, ref["weights"][k], **WEIGHT_TOL["adam"],
                                           msg=lambda m, tp=tp, nproc=nproc, k=k: f"TP={tp} x {nproc} {k}: {m}")


@pytest.mark.slow
def test_a_dp1_checkpoint_of_the_default_optimizer_resumes_at_dp2(tiny_model, tmp_path):
    """Adam's default at DP=1 is megatron's plain optimizer, at DP=2 its distributed one: two steps
    at DP=1, a checkpoint, a third step; the checkpoint loaded by fresh actors at DP=2 (the state
    converted from the plain optimizer's to the distributed one's on load) and at TP=2 x DP=1
    continues with the same third step, to the tolerances of the DP=2 -> DP=1 test above (the
    other direction: it resumes a distributed optimizer's checkpoint with the plain one)."""
    run_dir = str(tmp_path / "run")
    straight = run_torchrun("tests.dist.trainer_checkpoint:save_then_continue", 1, timeout_s=600,
                            args={"tp": 1, "hf_dir": tiny_model, "run_dir": run_dir})
    assert {r["optimizer"] for r in straight} == {"FP32Optimizer"}
    ref = straight[0]
    for tp, nproc in ((1, 2), (2, 2)):
        resumed = run_torchrun("tests.dist.trainer_checkpoint:resume_and_step", nproc, timeout_s=600,
                               args={"tp": tp, "hf_dir": tiny_model, "run_dir": run_dir})
        for r in resumed:
            assert r["state"] == {"step": 2} and r["dp_size"] == nproc // tp
            assert r["third"]["lr"] == ref["third"]["lr"]
            for key in ("loss/total", "grad_norm", "entropy"):
                assert r["third"][key] == pytest.approx(ref["third"][key], **METRIC_TOL), (tp, key)
            for k, w in r["weights"].items():
                torch.testing.assert_close(w, ref["weights"][k], **WEIGHT_TOL["adam"],
                                           msg=lambda m, tp=tp, k=k: f"TP={tp} {k}: {m}")
