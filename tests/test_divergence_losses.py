"""Policy losses against textbook references written here (PPO/DAPO, dual-clip, GSPO, SAPO, TIS),
the unified clipping rule against Lambert-W ratio clipping, the KL-placement facts by exact
enumeration, aggregation, config validation, metrics, and float64 gradcheck of every loss."""
import itertools
import math
import typing

import pytest
import torch
from scipy.special import lambertw

from megadiv.config import ConfigError, from_dict
from megadiv.divergence import (
    DIVERGENCES,
    POLICY_LOSSES,
    PolicyLossConfig,
    RatioDivergence,
    VocabDivergence,
    aggregate_loss,
    aggregation_denominator,
    compute_policy_loss,
    get_divergence,
    kl_reward_penalty,
    names_of_kind,
    ratio_bounds,
    register_divergence,
)
from megadiv.divergence.losses import LossAggregation

AGGREGATIONS = typing.get_args(LossAggregation)
F64 = torch.float64


def make_batch(B=6, T=9, seed=0, spread=0.3):
    """Random [B, T] log-probs with ratios w = exp(logp - logp_old) spread around 1, sequence
    advantages of both signs, ragged lengths and one all-padding row."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05)
    logp_old = logp + spread * torch.randn(B, T, generator=g, dtype=F64)
    logp_ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    logp_rollout = logp_old + 0.1 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[-1] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    return dict(logp=logp, logp_old=logp_old, logp_ref=logp_ref, logp_rollout=logp_rollout, adv=adv, mask=mask)


def loss_and_grad(cfg, b, **kwargs):
    logp = b["logp"].clone().requires_grad_()
    loss, metrics = compute_policy_loss(cfg, logp, b["logp_old"], b["adv"], b["mask"], logp_ref=b["logp_ref"],
                                        logp_rollout=b["logp_rollout"], **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def reference_grad(fn, b):
    logp = b["logp"].clone().requires_grad_()
    loss = fn(logp)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def ppo_reference(logp, b, eps_low, eps_high, dual_clip_c=None):
    """Textbook PPO/GRPO/DAPO, token-mean: max(-A w, -A clip(w, 1-eps_low, 1+eps_high)), with
    dual-clip min(., -c A) for A < 0 (verl's formulation)."""
    w = torch.exp(logp - b["logp_old"])
    adv = b["adv"][:, None]
    loss = torch.maximum(-adv * w, -adv * torch.clamp(w, 1 - eps_low, 1 + eps_high))
    if dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip_c), loss)
    return (loss * b["mask"]).sum() / b["mask"].sum()


def assert_same(got, want):
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)


# --------------------------------------------------------------------------- clipping == PPO


@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.2), (0.2, 0.28)])
def test_clip_and_ratio_divergence_clip_reproduce_ppo_and_dapo(eps_low, eps_high):
    b = make_batch()
    want_loss, want_grad = reference_grad(lambda lp: ppo_reference(lp, b, eps_low, eps_high), b)
    w = torch.exp(b["logp"] - b["logp_old"])
    a = b["adv"][:, None].expand_as(w)
    on = b["mask"] > 0
    n_high = ((w > 1 + eps_high) & (a > 0) & on).sum()
    n_low = ((w < 1 - eps_low) & (a < 0) & on).sum()
    assert n_high > 0 and n_low > 0, "the batch must exercise both clip sides"
    for cfg in (PolicyLossConfig(policy_loss="clip", eps_low=eps_low, eps_high=eps_high),
                PolicyLossConfig(policy_loss="divergence_clip", measure="ratio", delta=eps_low, delta_high=eps_high)):
        loss, grad, metrics = loss_and_grad(cfg, b)
        assert_same(loss, want_loss)
        assert_same(grad, want_grad)
        n = b["mask"].sum()
        assert_same(metrics["clip/frac_high"], n_high / n)
        assert_same(metrics["clip/frac_low"], n_low / n)


def test_dual_clip_matches_reference():
    b = make_batch()
    b["logp_old"][:3, :4] = b["logp"][:3, :4] - 1.5  # w = e^1.5 ~ 4.5 > c
    b["adv"][:3] = -b["adv"][:3].abs()
    want_loss, want_grad = reference_grad(lambda lp: ppo_reference(lp, b, 0.2, 0.28, dual_clip_c=3.0), b)
    for cfg in (PolicyLossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0),
                PolicyLossConfig(policy_loss="divergence_clip", measure="ratio", delta=0.2, delta_high=0.28,
                                 dual_clip_c=3.0)):
        loss, grad, metrics = loss_and_grad(cfg, b)
        assert_same(loss, want_loss)
        assert_same(grad, want_grad)
        assert float(metrics["clip/frac_dual"]) > 0


def _k3_bounds_scipy(delta):
    x = -math.exp(-1 - delta)
    return -lambertw(x, 0).real, -lambertw(x, -1).real


@pytest.mark.parametrize("delta, delta_high", [(0.05, None), (0.0231, 0.0331), (0.01, 0.1)])
def test_k3_clipping_is_ratio_clipping_with_lambert_w_bounds(delta, delta_high):
    """Clipping on k3(w) <= delta (the mask computed from k3 itself) equals PPO clipping at
    [-W_0(-e^(-1-delta)), -W_-1(-e^(-1-delta_high))], the bounds from scipy's Lambert W."""
    b = make_batch(seed=1)
    low = _k3_bounds_scipy(delta)[0]
    high = _k3_bounds_scipy(delta if delta_high is None else delta_high)[1]
    want_loss, want_grad = reference_grad(lambda lp: ppo_reference(lp, b, 1 - low, high - 1), b)
    loss, grad, _ = loss_and_grad(PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=delta,
                                                   delta_high=delta_high), b)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-12)
    assert_same(grad, want_grad)


@pytest.mark.parametrize("measure", names_of_kind(RatioDivergence))
def test_every_ratio_measure_clips_like_its_ratio_interval(measure):
    b = make_batch(seed=2)
    low, high = ratio_bounds(measure, 0.04)
    want_loss, want_grad = reference_grad(lambda lp: ppo_reference(lp, b, 1 - low, high - 1), b)
    loss, grad, _ = loss_and_grad(PolicyLossConfig(policy_loss="divergence_clip", measure=measure, delta=0.04), b)
    assert_same(loss, want_loss)
    assert_same(grad, want_grad)


def test_unified_rule_with_a_measure_that_is_not_a_ratio_interval():
    """sampled_prob_l2 = p_old^2 (w - 1)^2: the trust region is per token. Clipped tokens (D > delta
    and sign(A)(w - 1) > 0) get no gradient and keep the value -A w; all others get -A grad w."""
    b = make_batch(seed=3)
    delta = 0.002
    loss, grad, metrics = loss_and_grad(PolicyLossConfig(policy_loss="divergence_clip", measure="sampled_prob_l2",
                                                         delta=delta), b)
    w = torch.exp(b["logp"] - b["logp_old"])
    a = b["adv"][:, None].expand_as(w)
    d = (torch.exp(b["logp"]) - torch.exp(b["logp_old"])) ** 2
    clipped = (d > delta) & (torch.sign(a) * (w - 1) > 0)
    n = b["mask"].sum()
    assert 0 < float((clipped * b["mask"]).sum()) < float(n)
    assert_same(loss, (-a * w * b["mask"]).sum() / n)
    assert_same(grad, torch.where(clipped, 0.0, -a * w) * b["mask"] / n)
    assert_same(metrics["clip/frac_high"] + metrics["clip/frac_low"], (clipped * b["mask"]).sum() / n)


# --------------------------------------------------------------------------- other surrogates


def test_gspo_token_form_equals_sequence_level_gspo():
    b = make_batch(seed=4)
    eps_low, eps_high = 0.03, 0.04

    def gspo_reference(logp):
        m = b["mask"]
        seq = m.sum(-1) > 0
        s = torch.exp(((logp - b["logp_old"]) * m).sum(-1)[seq] / m.sum(-1)[seq])  # [sequences]
        adv = b["adv"][seq]
        clipped_s = torch.clamp(s, 1 - eps_low, 1 + eps_high)
        inside = (s > 1 - eps_low) & (s < 1 + eps_high)
        assert bool(inside.any()) and not bool(inside.all()), "the batch must clip some sequences, not all"
        return torch.maximum(-adv * s, -adv * clipped_s).mean()

    want_loss, want_grad = reference_grad(gspo_reference, b)
    cfg = PolicyLossConfig(policy_loss="gspo", eps_low=eps_low, eps_high=eps_high, loss_agg="seq-mean-token-mean")
    loss, grad, _ = loss_and_grad(cfg, b)
    assert_same(loss, want_loss)
    assert_same(grad, want_grad)
    # GSPO-token: per-token weights (here truncated IS) scale each token's share of the gradient
    tis = torch.clamp(torch.exp(b["logp_old"] - b["logp_rollout"]), max=1.05)
    _, grad_tis, _ = loss_and_grad(PolicyLossConfig(**{**cfg.__dict__, "tis_cap": 1.05}), b)
    assert_same(grad_tis, grad * tis)


def test_sapo_soft_gate():
    b = make_batch(seed=5)
    cfg = PolicyLossConfig(policy_loss="sapo", tau_pos=1.0, tau_neg=1.05)

    def sapo_reference(logp):
        w = torch.exp(logp - b["logp_old"])
        adv = b["adv"][:, None]
        tau = torch.where(adv > 0, 1.0, 1.05).to(F64)
        return (-adv * torch.sigmoid(tau * (w - 1)) * 4 / tau * b["mask"]).sum() / b["mask"].sum()

    want_loss, want_grad = reference_grad(sapo_reference, b)
    loss, grad, _ = loss_and_grad(cfg, b)
    assert_same(loss, want_loss)
    assert_same(grad, want_grad)
    # on-policy (w = 1) the gate's slope is 1: the gradient is the plain policy gradient
    b["logp_old"] = b["logp"].clone()
    _, grad_sapo, metrics = loss_and_grad(cfg, b)
    _, grad_clip, _ = loss_and_grad(PolicyLossConfig(), b)
    assert_same(grad_sapo, grad_clip)
    assert_same(metrics["sapo/slope_mean"], torch.tensor(1.0, dtype=F64))


def test_truncated_importance_sampling():
    b = make_batch(seed=6)
    cap = 1.05
    tis = torch.clamp(torch.exp(b["logp_old"] - b["logp_rollout"]), max=cap)

    def reference(logp):
        w = torch.exp(logp - b["logp_old"])
        adv = b["adv"][:, None]
        tok = torch.maximum(-adv * w, -adv * torch.clamp(w, 0.8, 1.2)) * tis
        return (tok * b["mask"]).sum() / b["mask"].sum()

    want_loss, want_grad = reference_grad(reference, b)
    loss, grad, metrics = loss_and_grad(PolicyLossConfig(tis_cap=cap), b)
    assert_same(loss, want_loss)
    assert_same(grad, want_grad)
    on = b["mask"] > 0
    truncated = (torch.exp(b["logp_old"] - b["logp_rollout"]) > cap) & on
    assert 0 < int(truncated.sum()) < int(on.sum())
    assert_same(metrics["tis/truncated_frac"], truncated.sum().to(F64) / on.sum())
    with pytest.raises(ValueError, match="logp_rollout"):
        compute_policy_loss(PolicyLossConfig(tis_cap=cap), b["logp"], b["logp_old"], b["adv"], b["mask"])


# --------------------------------------------------------------------------- KL and regularisers


def test_kl_placement_gradients():
    """'A Comedy of Estimators', checked exactly: a categorical policy over K actions, each action
    one length-1 sequence, the expectation over a ~ pi taken by weighting the token-mean with
    mask = pi (detached). Reverse KL R = KL(pi || pi_ref), forward F = KL(pi_ref || pi)."""
    K = 7
    g = torch.Generator().manual_seed(7)
    theta0 = torch.randn(K, generator=g, dtype=F64)
    logp_ref = torch.log_softmax(torch.randn(K, generator=g, dtype=F64), 0)[:, None]  # [K, 1]

    def grad_of(fn):
        theta = theta0.clone().requires_grad_()
        (grad,) = torch.autograd.grad(fn(torch.log_softmax(theta, 0)[:, None]), theta)
        return grad

    reverse = grad_of(lambda lp: (lp.exp() * (lp - logp_ref)).sum())
    forward = grad_of(lambda lp: (logp_ref.exp() * (logp_ref - lp)).sum())

    def in_loss(estimator):
        cfg = PolicyLossConfig(kl_coef=1.0, kl_estimator=estimator)
        return grad_of(lambda lp: compute_policy_loss(cfg, lp, lp.detach(), torch.zeros(K, dtype=F64),
                                                      lp.detach().exp(), logp_ref=logp_ref)[0])

    def in_reward(estimator):
        def loss(lp):
            rewards = -kl_reward_penalty(estimator, 1.0, lp.detach(), logp_ref, torch.ones_like(lp))  # [K]
            return compute_policy_loss(PolicyLossConfig(), lp, lp.detach(), rewards, lp.detach().exp())[0]
        return grad_of(loss)

    assert_same(in_reward("k1"), reverse)
    assert_same(in_loss("k2"), reverse)
    assert_same(in_loss("k3"), forward)
    assert_same(in_loss("k1"), torch.zeros(K, dtype=F64))
    for biased in (in_reward("k3"), in_reward("k2")):
        assert (biased - reverse).abs().max() > 1e-3 and (biased - forward).abs().max() > 1e-3


def test_kl_penalty_in_loss_and_regularizer_terms():
    b = make_batch(seed=8)
    base = PolicyLossConfig()
    cfg = PolicyLossConfig(kl_coef=0.1, kl_estimator="k3", regularizer="sampled_prob_l2", regularizer_coef=0.5)
    loss0, grad0, _ = loss_and_grad(base, b)

    def extra(logp):
        r = torch.exp(b["logp_ref"] - logp)
        k3 = r - 1 - torch.log(r)
        l2 = (logp.exp() - b["logp_ref"].exp()) ** 2
        return ((0.1 * k3 + 0.5 * l2) * b["mask"]).sum() / b["mask"].sum()

    want_extra, want_grad_extra = reference_grad(extra, b)
    loss, grad, metrics = loss_and_grad(cfg, b)
    assert_same(loss, loss0 + want_extra)
    assert_same(grad, grad0 + want_grad_extra)
    assert_same(metrics["loss/total"], loss)
    assert_same(metrics["loss/policy"] + 0.1 * metrics["loss/kl"] + 0.5 * metrics["loss/regularizer"], loss)
    # the reward placement leaves the loss alone
    loss_r, _, _ = loss_and_grad(PolicyLossConfig(kl_coef=0.1, kl_placement="reward"), b)
    assert_same(loss_r, loss0)
    with pytest.raises(ValueError, match="needs logp_ref"):
        compute_policy_loss(PolicyLossConfig(kl_coef=0.1), b["logp"], b["logp_old"], b["adv"], b["mask"])


@pytest.fixture
def scratch_vocab_measure():
    """A full-vocabulary measure registered for one test: exact KL(p || p_base) of unsharded logits."""
    @register_divergence("scratch_full_kl")
    class FullKL(VocabDivergence):
        def forward(self, logits, logits_base, group=None, vocab_start=0, vocab_size=None):
            logq, logq_base = torch.log_softmax(logits, -1), torch.log_softmax(logits_base, -1)
            return (logq.exp() * (logq - logq_base)).sum(-1)
    yield "scratch_full_kl"
    del DIVERGENCES["scratch_full_kl"]


def test_full_vocab_regularizer_and_clip_divergence_inputs(scratch_vocab_measure):
    b = make_batch(B=3, T=4, seed=9)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 4, 5, generator=g, dtype=F64, requires_grad=True)
    logits_ref = torch.randn(3, 4, 5, generator=g, dtype=F64)
    cfg = PolicyLossConfig(regularizer=scratch_vocab_measure, regularizer_coef=0.3)

    def loss_of(logp, logits):
        vd = get_divergence(scratch_vocab_measure)(logits, logits_ref)  # [B, T]
        return compute_policy_loss(cfg, logp, b["logp_old"], b["adv"], b["mask"], vocab_divergence=vd)[0]

    logp = b["logp"].clone().requires_grad_()
    loss = loss_of(logp, logits)
    vd = get_divergence(scratch_vocab_measure)(logits, logits_ref).detach()
    loss0 = compute_policy_loss(PolicyLossConfig(), b["logp"], b["logp_old"], b["adv"], b["mask"])[0]
    assert_same(loss.detach(), loss0 + 0.3 * (vd * b["mask"]).sum() / b["mask"].sum())
    assert torch.autograd.gradcheck(loss_of, (logp, logits))
    with pytest.raises(ValueError, match="pass its per-token values as vocab_divergence"):
        compute_policy_loss(cfg, b["logp"], b["logp_old"], b["adv"], b["mask"])
    with pytest.raises(ValueError, match="not a full-vocabulary measure"):
        compute_policy_loss(PolicyLossConfig(), b["logp"], b["logp_old"], b["adv"], b["mask"], vocab_divergence=vd)
    # a full-vocabulary trust region: D(pi_theta, pi_old) per token comes in as clip_divergence
    clip_cfg = PolicyLossConfig(policy_loss="divergence_clip", measure=scratch_vocab_measure, delta=0.5)
    with pytest.raises(ValueError, match="clip_divergence"):
        compute_policy_loss(clip_cfg, b["logp"], b["logp_old"], b["adv"], b["mask"])
    _, metrics = compute_policy_loss(clip_cfg, b["logp"], b["logp_old"], b["adv"], b["mask"], clip_divergence=vd)
    w = torch.exp(b["logp"] - b["logp_old"])
    clipped = (vd > 0.5) & (torch.sign(b["adv"][:, None]) * (w - 1) > 0)
    assert_same(metrics["clip/frac_low"] + metrics["clip/frac_high"],
                (clipped * b["mask"]).sum() / b["mask"].sum())


def test_full_prob_l2_regularizer_from_the_vocab_parallel_library():
    """The real full-vocabulary ProbL2 (TP = 1) as GBMPO's regulariser: the loss adds
    coef * token-mean(sum_v (p_v - p_ref,v)^2), and its gradient reaches the logits."""
    b = make_batch(B=3, T=4, seed=13)
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(12, 7, generator=g, dtype=F64, requires_grad=True)  # [B*T, V]
    logits_ref = torch.randn(12, 7, generator=g, dtype=F64)
    cfg = PolicyLossConfig(regularizer="full_prob_l2", regularizer_coef=0.3)
    vd = get_divergence("full_prob_l2")(logits, logits_ref).view(3, 4)
    loss, _ = compute_policy_loss(cfg, b["logp"], b["logp_old"], b["adv"], b["mask"], vocab_divergence=vd)
    closed = ((torch.softmax(logits, -1) - torch.softmax(logits_ref, -1)) ** 2).sum(-1).view(3, 4)
    loss0, _ = compute_policy_loss(PolicyLossConfig(), b["logp"], b["logp_old"], b["adv"], b["mask"])
    want = loss0 + 0.3 * (closed * b["mask"]).sum() / b["mask"].sum()
    assert_same(loss, want)
    assert_same(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(want, logits)[0])


# --------------------------------------------------------------------------- aggregation


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)  # row 3: padding
    want = {"token-mean": 7 / 3, "seq-mean-token-mean": (1.5 + 4) / 2, "seq-mean-token-sum": 7 / 2,
            "seq-mean-token-sum-norm": 7 / (3 * 3)}
    for mode, value in want.items():
        assert float(aggregate_loss(loss, mask, mode)) == pytest.approx(value, rel=1e-15)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=10)) == pytest.approx(7 / 30)
    for mode in AGGREGATIONS:  # an empty batch gives 0, not NaN
        assert float(aggregate_loss(loss, torch.zeros_like(mask), mode)) == 0.0
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(loss, mask, "token-sum")


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_with_the_global_denominator_sum_to_the_batch_loss(mode):
    b = make_batch(B=8, seed=10)
    cfg = PolicyLossConfig(loss_agg=mode, loss_norm_len=12)
    full, grad_full, _ = loss_and_grad(cfg, b)
    parts = [{k: v[rows] for k, v in b.items()} for rows in (slice(0, 3), slice(3, 8))]
    # the global denominator: the micro-batches' own denominators, summed
    denominator = sum(aggregation_denominator(p["mask"], mode, norm_len=12) for p in parts)
    m = b["mask"]
    assert float(denominator) == {"token-mean": float(m.sum()), "seq-mean-token-mean": 7.0,
                                  "seq-mean-token-sum": 7.0, "seq-mean-token-sum-norm": 96.0}[mode]
    total, grads = 0.0, []
    for part in parts:
        loss, grad, _ = loss_and_grad(cfg, part, denominator=denominator)
        total, grads = total + loss, grads + [grad]
    assert_same(total, full)
    assert_same(torch.cat(grads), grad_full)


# --------------------------------------------------------------------------- gradcheck of every loss

OPTIONS = {
    "plain": {},
    "dual_clip": dict(dual_clip_c=1.5),
    "tis": dict(tis_cap=1.05),
    "kl_k1": dict(kl_coef=0.3, kl_estimator="k1"),
    "kl_k2": dict(kl_coef=0.3, kl_estimator="k2"),
    "kl_k3": dict(kl_coef=0.3, kl_estimator="k3"),
    "prob_l2": dict(regularizer="sampled_prob_l2", regularizer_coef=0.7),
}
LOSS_KWARGS = {"clip": dict(eps_low=0.2, eps_high=0.28), "divergence_clip": dict(measure="k3", delta=0.02),
               "gspo": dict(eps_low=0.02, eps_high=0.03), "sapo": {}}


def _gradcheck_cases():
    for name, mode in itertools.product(POLICY_LOSSES, AGGREGATIONS):
        yield name, mode, "plain"
    for name, option in itertools.product(POLICY_LOSSES, OPTIONS):
        # sapo has no dual-clip; gspo's token form s_it = sg[s_i] pi_t / sg[pi_t] defines a gradient,
        # not a value: with per-token TIS weights the two part ways by design (tested in the gspo test)
        if option != "plain" and (name, option) not in {("sapo", "dual_clip"), ("gspo", "tis")}:
            yield name, "token-mean", option


def test_every_registered_loss_is_covered():
    assert set(POLICY_LOSSES) == set(LOSS_KWARGS), "add the new loss to LOSS_KWARGS (and a reference test)"


@pytest.mark.parametrize("name, mode, option", list(_gradcheck_cases()))
def test_gradcheck(name, mode, option):
    b = make_batch(B=3, T=5, seed=11, spread=0.4)
    b["logp_old"][0, :2] = b["logp"][0, :2] - 0.7  # w ~ 2 > dual-clip c with A < 0
    b["adv"][0] = -1.0
    cfg = PolicyLossConfig(policy_loss=name, loss_agg=mode, **LOSS_KWARGS[name], **OPTIONS[option])

    def fn(logp):
        return compute_policy_loss(cfg, logp, b["logp_old"], b["adv"], b["mask"], logp_ref=b["logp_ref"],
                                   logp_rollout=b["logp_rollout"])[0]
    assert torch.autograd.gradcheck(fn, (b["logp"].clone().requires_grad_(),))


# --------------------------------------------------------------------------- config and metrics


@pytest.mark.parametrize("field, value", [
    ("policy_loss", "ppo2"), ("eps_low", 0.0), ("eps_low", 1.0), ("eps_high", -0.1), ("dual_clip_c", 1.0),
    ("measure", "kl9"), ("delta", 0.0), ("delta", math.inf), ("delta_high", -1.0), ("tau_neg", 0.0),
    ("kl_coef", -1.0), ("kl_estimator", "k4"), ("kl_placement", "advantage"), ("regularizer", "l3"),
    ("regularizer_coef", 1e-4), ("loss_agg", "token-sum"), ("loss_norm_len", 0), ("tis_cap", 0.5)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**{field: value})


def test_config_rejects_dual_clip_for_sapo_and_loads_from_yaml_dicts():
    with pytest.raises(ValueError, match="dual_clip_c is not supported by policy_loss 'sapo'"):
        PolicyLossConfig(policy_loss="sapo", dual_clip_c=3.0)
    cfg = from_dict(PolicyLossConfig, {"policy_loss": "divergence_clip", "measure": "k3", "delta": 0.0231,
                                       "delta_high": 0.0331, "loss_agg": "seq-mean-token-sum-norm",
                                       "loss_norm_len": 1024, "tis_cap": 2})
    assert cfg.tis_cap == 2.0 and cfg.delta_high == 0.0331
    with pytest.raises(ConfigError, match="eps_low"):
        from_dict(PolicyLossConfig, {"eps_low": 1.5})
    with pytest.raises(ConfigError, match="loss_agg"):
        from_dict(PolicyLossConfig, {"loss_agg": "mean"})


def test_metrics():
    b = make_batch(seed=12)
    entropy = torch.rand_like(b["logp"])
    _, _, metrics = loss_and_grad(PolicyLossConfig(kl_coef=0.1, tis_cap=2.0), b, entropy=entropy)
    m, on = b["mask"], b["mask"] > 0

    def mean(x):
        return (x * m).sum() / m.sum()

    w = torch.exp(b["logp"] - b["logp_old"])
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert_same(metrics["ratio/mean"], mean(w))
    assert_same(metrics["ratio/max"], w[on].max())
    assert_same(metrics["ratio/min"], w[on].min())
    assert_same(metrics["entropy"], mean(entropy))
    for name in names_of_kind(RatioDivergence) + ["sampled_prob_l2"]:
        assert f"old/{name}" in metrics and f"ref/{name}" in metrics and f"mismatch/{name}" in metrics
    # k1/k2/k3 vs old estimate KL(pi_old || pi_theta); vs ref KL(pi_theta || pi_ref); mismatch KL(pi_rollout || pi_old)
    assert_same(metrics["old/k1"], mean(b["logp_old"] - b["logp"]))
    assert_same(metrics["old/k3"], mean(w - 1 - torch.log(w)))
    assert_same(metrics["ref/k1"], mean(b["logp"] - b["logp_ref"]))
    r = torch.exp(b["logp_ref"] - b["logp"])
    assert_same(metrics["ref/k3"], mean(r - 1 - torch.log(r)))
    assert_same(metrics["ref/k2"], mean(torch.log(r) ** 2 / 2))
    assert_same(metrics["mismatch/k1"], mean(b["logp_rollout"] - b["logp_old"]))
    assert_same(metrics["mismatch/abs_log_ratio_max"], (b["logp_old"] - b["logp_rollout"]).abs()[on].max())
    assert_same(metrics["loss/kl"], metrics["ref/k3"])


def test_shape_errors_and_sequence_advantages():
    b = make_batch()
    with pytest.raises(ValueError, match="logp_old has shape"):
        compute_policy_loss(PolicyLossConfig(), b["logp"], b["logp_old"][:, :-1], b["adv"], b["mask"])
    loss_seq, _ = compute_policy_loss(PolicyLossConfig(), b["logp"], b["logp_old"], b["adv"], b["mask"])
    loss_tok, _ = compute_policy_loss(PolicyLossConfig(), b["logp"], b["logp_old"],
                                      b["adv"][:, None].expand_as(b["logp"]), b["mask"])
    assert_same(loss_seq, loss_tok)


@pytest.mark.gpu
def test_no_host_synchronisation_on_cuda():
    """Loss, metrics and backward queue on the device without a host sync (style rule 9)."""
    b = {k: v.cuda() for k, v in make_batch().items()}
    cfg = PolicyLossConfig(policy_loss="divergence_clip", measure="k3", delta=0.05, delta_high=0.07, dual_clip_c=3.0,
                           kl_coef=0.1, regularizer="sampled_prob_l2", regularizer_coef=1e-4, tis_cap=2.0,
                           loss_agg="seq-mean-token-mean")
    logp = b["logp"].clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = compute_policy_loss(cfg, logp, b["logp_old"], b["adv"], b["mask"], logp_ref=b["logp_ref"],
                                            logp_rollout=b["logp_rollout"], entropy=b["logp"].neg())
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(v.is_cuda for v in metrics.values()) and logp.grad.is_cuda
