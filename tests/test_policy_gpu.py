"""The policy step on one GPU: what the CPU device guard (tests/test_device_placement.py) stands
in for. Reference and old log-probs, KL in the reward (an NCCL all-reduce), two updates with a
full-vocabulary regulariser, metric reduction, the post-sync probe (an object broadcast), in
float32, bf16, and bf16 with FP8 GEMMs (Transformer Engine, sequences padded to 16).
TP markers on every parameter of a Transformer Engine model built from loaded weights."""
import math

import pytest

from tests.torchrun import run_torchrun

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fp8_sized_model(tmp_path_factory):
    from megadiv.models.tiny import make_tiny_model

    # FP8 GEMMs need every dimension a multiple of 16: hidden 128, QKV 256, MLP 512
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", tokenizer="bpe", vocab=301,
                               hidden=128, heads=4, kv_heads=2, ffn=512, layers=2))


@pytest.mark.parametrize("overrides", [[], ["model.params_dtype=bfloat16"],
                                       ["model.params_dtype=bfloat16", "model.fp8=tensorwise"]],
                         ids=["fp32", "bf16", "fp8"])
def test_policy_step_on_one_gpu(fp8_sized_model, overrides):
    if "model.fp8=tensorwise" in overrides:
        pytest.importorskip("transformer_engine", reason="FP8 needs Transformer Engine")
    (res,) = run_torchrun("tests.dist.device_placement:policy_step_on_gpu", 1, timeout_s=600, cuda=True,
                          args={"hf_dir": fp8_sized_model, "overrides": overrides})
    print(res)
    assert res["device"].startswith("cuda")
    assert res["probe_devices"] == ["cpu"] and res["probe_finite"]
    assert res["seq_multiple"] == (16 if "model.fp8=tensorwise" in overrides else 1)
    for key in ("loss/total", "loss/regularizer", "grad_norm", "entropy"):
        assert math.isfinite(res["metrics"][key]), key
    assert res["metrics"]["skipped"] == 0.0


def test_tp_markers_on_a_transformer_engine_model(fp8_sized_model):
    pytest.importorskip("transformer_engine", reason="needs Transformer Engine")
    (markers,) = run_torchrun("tests.dist.device_placement:tp_markers", 1, timeout_s=300, cuda=True,
                              args={"hf_dir": fp8_sized_model, "tp": 1})
    missing = [name for name, m in markers.items() if None in m]
    assert not missing, missing
    assert markers["embedding.word_embeddings.weight"][:2] == (True, 0)
    assert markers["output_layer.weight"][:2] == (True, 0)
