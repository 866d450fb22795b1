"""The vocab-parallel primitives on a GPU at a real vocabulary (Qwen2's 151,936 columns): values
and gradients against torch's own log_softmax / entropy / KL, GPU-sized chunks, and no host
synchronisation anywhere in forward or backward (torch.cuda.set_sync_debug_mode("error") raises
on any device-to-host copy or synchronising call).

Tolerances: float32 logits, float32 statistics in both; the references reduce in one pass where
the primitives reduce chunk by chunk, so values agree to a few float32 ulps of their magnitude
(log-probs ~ -12: 1e-5 absolute), gradients (entries ~ 1/V) to 1e-6 relative to their largest."""
import pytest
import torch

import megadiv.divergence.full_vocab  # noqa: F401  (registers the full-vocabulary measures)
from megadiv.divergence import vocab_parallel as vp
from megadiv.divergence.registry import get_divergence

pytestmark = pytest.mark.gpu

TOKENS, VOCAB = 512, 151_936


def _inputs(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(TOKENS, VOCAB, device="cuda", generator=g) * 3
    zb = z + 0.3 * torch.randn(TOKENS, VOCAB, device="cuda", generator=g)
    target = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=g)
    return z, zb, target


def _close(a, b, scale=None):
    scale = scale if scale is not None else b.abs().max()
    assert (a - b).abs().max() <= 1e-6 * scale + 1e-5, float((a - b).abs().max())


def test_gpu_chunks_are_sized_by_bytes_with_a_row_floor():
    assert vp.default_chunk_rows(VOCAB, torch.device("cuda")) == (128 << 20) // (4 * VOCAB) == 220
    assert vp.default_chunk_rows(10_000_000, torch.device("cuda")) == 64      # the floor
    assert vp.default_chunk_rows(VOCAB, torch.device("cpu")) == 1             # cache-sized on CPU


def test_log_probs_and_entropy_match_torch_without_host_sync():
    z, _, target = _inputs()
    ref_z = z.clone().requires_grad_()
    logp_ref = torch.log_softmax(ref_z, -1)
    ref_lp = logp_ref.gather(1, target[:, None]).squeeze(1)
    ref_ent = -(logp_ref.exp() * logp_ref).sum(-1)
    g_lp, g_ent = torch.randn(TOKENS, device="cuda"), torch.randn(TOKENS, device="cuda")
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()

    x = z.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent = vp.log_probs_and_entropy(x, target)
        (lp * g_lp + ent * g_ent).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert lp.device.type == ent.device.type == x.grad.device.type == "cuda"
    _close(lp, ref_lp.detach())
    _close(ent, ref_ent.detach())
    _close(x.grad, ref_z.grad)


@pytest.mark.parametrize("name", ["full_kl", "full_prob_l2"])
def test_full_vocabulary_divergences_match_torch_without_host_sync(name):
    z, zb, _ = _inputs(1)
    rz, rzb = z.clone().requires_grad_(), zb.clone().requires_grad_()
    a, b = torch.log_softmax(rz, -1), torch.log_softmax(rzb, -1)
    ref = (a.exp() * (a - b)).sum(-1) if name == "full_kl" else ((a.exp() - b.exp()) ** 2).sum(-1)
    g = torch.randn(TOKENS, device="cuda")
    (ref * g).sum().backward()

    x, xb = z.clone().requires_grad_(), zb.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        d = get_divergence(name)(x, xb)
        (d * g).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _close(d, ref.detach())
    _close(x.grad, rz.grad)
    _close(xb.grad, rzb.grad)
