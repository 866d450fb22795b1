"""Transformer Engine spec with FP8 vs megatron's local spec in bf16 (needs CUDA and TE).

Tolerances: the TE spec in bf16 computes the same network as the local spec in bf16, so only
kernel and accumulation-order differences remain (relative L2 error of the logits <= 2e-2).
FP8 (E4M3 forward, per-tensor current scaling, 'tensorwise') keeps 3 mantissa bits, a relative
rounding error up to 2^-4 per operand: the logits may move by a few percent (<= 1e-1 relative
L2) and log-probabilities by <= 0.5 at most on this 2-layer random model.
"""
import pytest

from tests.torchrun import run_torchrun

pytestmark = pytest.mark.gpu


def test_te_fp8_logits_close_to_local_bf16(tmp_path):
    pytest.importorskip("transformer_engine", reason="needs Transformer Engine")
    from megadiv.models.tiny import make_tiny_model

    # FP8 GEMMs need every dimension a multiple of 16: hidden 128, QKV 256, MLP 512, 128 tokens
    hf_dir = make_tiny_model(tmp_path / "fp8", "qwen2", hidden=128, heads=4, kv_heads=2, ffn=512, layers=2)
    (res,) = run_torchrun("tests.dist.models:te_fp8_vs_bf16", 1, timeout_s=600,
                          args={"models": {"fp8": str(hf_dir)}, "tmp": str(tmp_path)}, cuda=True)
    print(res)
    assert res["rel_l2/te_bf16"] <= 2e-2, res
    assert res["rel_l2/te_fp8"] <= 1e-1, res
    assert res["logprob_max_abs/te_fp8"] <= 0.5, res


def test_te_grouped_experts_match_transformers_and_the_local_spec(tmp_path):
    """The tiny Qwen3-MoE and Qwen2-MoE on Transformer Engine's spec (TEGroupedMLP: one grouped
    GEMM over a rank's experts) in float32 without TF32: logits against transformers', export and
    a local-spec checkpoint loaded into it exact, and the trainer's log-probs and first step's
    gradients against the local spec's (kernel and summation-order differences only). Not yet run
    on a GPU: the tolerances are those of float32 sums in another order, to be tightened from
    the first run's figures."""
    pytest.importorskip("transformer_engine", reason="needs Transformer Engine")
    from tests.dist.models_moe import make_moe_models

    models = make_moe_models(tmp_path)
    (res,) = run_torchrun("tests.dist.models_moe:te_experts_vs_local", 1, timeout_s=600,
                          args={"models": models, "tmp": str(tmp_path)}, cuda=True)
    print(res)
    for name, r in res.items():
        assert r["grouped"] and r["export_exact"] and r["grad_names_match"], (name, r)
        assert "local_ckpt_error" not in r and r["local_ckpt_logit_diff"] == 0.0, (name, r)
        assert r["logit_diff"] <= 1e-4, (name, r)
        assert r["logp_diff"] <= 1e-4 and r["grad_rel"] <= 1e-4, (name, r)
