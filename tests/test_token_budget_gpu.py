"""Token-budget micro-batches, each at its own width and packed (grpo.pack_sequences: THD layout,
Transformer Engine attention with megatron's packed_seq_params), against the padded path on one
GPU (written without a GPU at hand: not yet run). Needs CUDA and Transformer
Engine; the packing itself (ModelInput.packed) is checked on CPU in tests/test_token_budget.py."""
import pytest
import torch

from tests.torchrun import run_torchrun

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megadiv.models.tiny import make_tiny_model

    # bf16 TE kernels: dimensions multiples of 16
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", tokenizer="bpe", vocab=301,
                               hidden=128, heads=4, kv_heads=2, ffn=512, layers=2))


def test_token_budget_and_packed_sequences_train_like_the_padded_path_on_a_gpu(tiny_model):
    """bf16 on both paths; the packed path runs other attention kernels (THD) over other shapes,
    so the tolerances are bf16's (about 8 bits of mantissa), not float32's."""
    pytest.importorskip("transformer_engine", reason="packing needs Transformer Engine")
    (res,) = run_torchrun("tests.dist.token_budget:packed_vs_padded_on_gpu", 1, timeout_s=600, cuda=True,
                          args={"hf_dir": tiny_model})
    padded = res["padded"]
    print({path: [(s["loss/total"], s["grad_norm"]) for s in res[path]["steps"]]
           for path in ("padded", "budget", "packed", "packed_rows")})
    columns = torch.arange(padded["logp_ref"].shape[1])
    predicts = columns[None] < torch.tensor(res["lengths"])[:, None] - 1
    assert [res[path]["packed"] for path in ("padded", "budget", "packed", "packed_rows")] == [False, False, True, True]
    for path in ("budget", "packed", "packed_rows"):
        run = res[path]
        for p, q in zip(padded["steps"], run["steps"], strict=True):
            assert q["skipped"] == p["skipped"] == 0.0
            for key in ("loss/total", "grad_norm", "entropy"):
                assert q[key] == pytest.approx(p[key], rel=3e-2, abs=1e-3), (path, key)
        for key in ("logp_ref", "logp_old", "logp_after"):
            assert run[key].shape == padded[key].shape
            torch.testing.assert_close(run[key][predicts], padded[key][predicts], rtol=0, atol=5e-2,
                                       msg=lambda m, path=path, key=key: f"{path} {key}: {m}")
        for name, w in padded["weights"].items():
            torch.testing.assert_close(run["weights"][name], w, rtol=2e-2, atol=2e-3,
                                       msg=lambda m, path=path, name=name: f"{path} {name}: {m}")
