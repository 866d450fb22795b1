"""Logits at the response positions only (megadiv.models.output.logits_at): where the model input
points in the model's layout, and the policy's losses and gradients equal those of the output
layer applied to every position, at TP=2 (also with sequence parallelism), DP=2 (TP=1) and PP=2."""
from __future__ import annotations

import pytest
import torch

from megadiv.policy.batches import ModelInput
from tests.dist.response_logits import BUDGET, LAYOUTS, batch
from tests.torchrun import run_torchrun


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_model_input_points_at_the_response_positions(layout):
    """In the model's layout (megatron's [s, b] flattened; packed: [T]) ``index`` finds the token at
    each position that predicts a response token, ``targets`` the token it predicts, and
    ``to_rows`` puts values back at those positions of the [b, S] rows, zeros elsewhere."""
    rows = batch()
    if layout == "padded":
        x = ModelInput.padded(rows, rows.tokens.shape[1] + 2)
        flat = x.tokens.T.flatten()
    else:
        x = ModelInput.packed(rows, multiple=4)
        flat = x.tokens[0]
    mask = rows.loss_mask > 0
    n = int(mask.sum())
    assert x.index.shape == x.targets.shape == (n,) and n < rows.tokens.numel() / 4  # long prompts
    assert torch.equal(flat[x.index], rows.tokens[mask])
    assert torch.equal(x.targets, rows.tokens[:, 1:][mask[:, :-1]])
    values = torch.arange(1.0, n + 1, requires_grad=True)
    back = x.to_rows(values[None])
    assert back.shape == rows.tokens.shape and torch.equal(back[mask], values.detach())
    assert back[~mask].abs().sum() == 0
    back.sum().backward()
    assert torch.equal(values.grad, torch.ones(n))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megadiv.models.tiny import make_tiny_model

    # qwen2: tied embeddings (the output layer takes the embedding's weight; at PP=2 a copy of it)
    hf_dir = make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", tokenizer="bpe", vocab=301,
                             hidden=64, heads=4, kv_heads=2, ffn=128, layers=3)
    return run_torchrun("tests.dist.response_logits:response_vs_full", 2, timeout_s=900, args={"hf_dir": str(hf_dir)})


# Observed, response-only vs every position (float32 weights): log-probs bit-identical on an Intel
# Xeon, one float32 ulp apart on an AMD EPYC (4.8e-7 at |log p| in [4, 8): its kernels round the
# output layer's rows of another shape otherwise), metrics <= 7.7e-7 relative; gradients <= 4.2e-7 absolute (the tied output weight's, a sum over the rows
# the output layer saw: n rows here, every position there, zeros included, in another order).
# (float64 is out of reach here: megadiv's Megatron models are float32 or half, and the log-probs
# upcast to float32.)
METRIC_TOL = dict(rel=1e-6, abs=1e-9)
LOGP_ATOL, GRAD_ATOL = 1e-6, 1e-6  # log-probs: two ulps at |log p| < 8


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_response_logits_train_like_full_logits(runs, name):
    """Reference and old log-probs, the losses, KL, entropy, clip fractions, the regulariser and the
    gradient norm of two SGD steps, and every gradient of every rank at the second, padded and
    under a token budget (a padded micro-batch without any response position among them)."""
    worst = {"metric_rel": 0.0, "logp_abs": 0.0, "grad_abs": 0.0}
    for rank, r in enumerate(runs):
        out = r[name]
        assert out["dp_size"] == (2 if name == "dp2" else 1)
        configs = [k for k in out if isinstance(k, tuple)]
        assert configs == [(None, None), (BUDGET, None)] + ([(None, "full_prob_l2")] if name != "pp2" else [])
        for config in configs:
            new, full = out[config]["response"], out[config]["full"]
            keys = ("loss/total", "loss/policy", "loss/kl", "entropy", "grad_norm", "clip/frac_low",
                    "clip/frac_high") + (("loss/regularizer",) if config[1] else ())
            for step, (m_new, m_full) in enumerate(zip(new["steps"], full["steps"], strict=True)):
                for key in keys:
                    assert m_new[key] == pytest.approx(m_full[key], **METRIC_TOL), (name, rank, config, step, key)
                    worst["metric_rel"] = max(worst["metric_rel"],
                                              abs(m_new[key] - m_full[key]) / max(abs(m_full[key]), 1e-9))
            later = full["steps"][1]  # the actor has left the reference: KL and regulariser at work
            assert later["grad_norm"] > 0 and later["loss/kl"] > 0 and later["clip/frac_low"] + later["clip/frac_high"] > 0
            assert later.get("loss/regularizer", 1.0) > 0
            if out["last_stage"]:
                for key in ("logp_ref", "logp_old"):
                    torch.testing.assert_close(new[key], full[key], rtol=0, atol=LOGP_ATOL)
                    worst["logp_abs"] = max(worst["logp_abs"], float((new[key] - full[key]).abs().max()))
                    assert new[key][out["mask"] == 0].abs().sum() == 0  # only response positions
            else:
                assert new["logp_old"] is None and full["logp_old"] is None
            assert new["grads"].keys() == full["grads"].keys()
            for k, g in full["grads"].items():
                torch.testing.assert_close(new["grads"][k], g, rtol=0, atol=GRAD_ATOL,
                                           msg=lambda m, k=k, rank=rank, config=config: f"{name} rank {rank} {config} {k}: {m}")
                worst["grad_abs"] = max(worst["grad_abs"], float((new["grads"][k] - g).abs().max()))
            assert sum(float(g.abs().sum()) for g in full["grads"].values()) > 0
    print(f"\n{name}: response-only vs full logits, largest differences {worst}")
