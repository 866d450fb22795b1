"""Vocab-parallel primitives and full-vocabulary measures.

TP=1 (group=None): values against plain torch on the gathered vocabulary (log_softmax, entropy,
kl_div, softmax), float64 gradcheck of every primitive and every registered VocabDivergence,
padding, chunking, half precision, in-place backward, saved memory. Under torchrun/gloo: TP=2
and TP=4 values and gradients equal TP=1 (tests/dist/vocab_parallel.py, one launch per size).
"""
import pytest
import torch
import torch.nn.functional as F

import megadiv.divergence.full_vocab  # noqa: F401  (registers the full-vocabulary measures)
from benchmarks.bench_divergence import peak_allocated_bytes  # the benchmark's own measurement
from megadiv.divergence import vocab_parallel as vp
from megadiv.divergence.registry import VocabDivergence, get_divergence, names_of_kind
from tests.torchrun import run_torchrun

F64 = torch.float64
VOCAB_MEASURES = names_of_kind(VocabDivergence)


def logits(tokens=6, vocab=13, padded=16, seed=0, dtype=F64, lead=()):
    """Two logit tensors [*lead, tokens, padded] whose columns >= vocab are garbage padding, and
    targets [*lead, tokens] < vocab."""
    g = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(*lead, tokens, padded, generator=g, dtype=F64)
    zb = z + torch.randn(*lead, tokens, padded, generator=g, dtype=F64)
    z[..., vocab:], zb[..., vocab:] = 40.0, -40.0
    t = torch.randint(0, vocab, (*lead, tokens), generator=g)
    return z.to(dtype), zb.to(dtype), t


def reference_measure(name, z, zb, vocab):
    """Independent gathered-vocabulary computation of each registered full-vocabulary measure."""
    a, b = torch.log_softmax(z[..., :vocab], -1), torch.log_softmax(zb[..., :vocab], -1)
    if name == "full_kl":   # kl_div(input=log q, target=log p) = p (log p - log q): KL(p || q)
        return F.kl_div(b, a, reduction="none", log_target=True).sum(-1)
    if name == "full_prob_l2":
        return (a.exp() - b.exp()).square().sum(-1)
    if name == "full_mirror":
        return get_divergence(name).mirror_map.bregman(a.exp(), b.exp()).sum(-1)
    raise AssertionError(f"no reference for '{name}': add one here")


def test_registry_lists_the_full_vocabulary_measures():
    assert {"full_kl", "full_prob_l2", "full_mirror"} <= set(VOCAB_MEASURES)


@pytest.mark.parametrize("chunk", [1, 4, None])
def test_log_probs_and_entropy_match_torch(chunk):
    z, _, t = logits(lead=(2,))
    ref = torch.log_softmax(z[..., :13], -1)
    lp, ent = vp.log_probs_and_entropy(z, t, vocab_size=13, chunk_size=chunk)
    torch.testing.assert_close(lp, ref.gather(-1, t.unsqueeze(-1)).squeeze(-1), rtol=0, atol=1e-13)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), rtol=0, atol=1e-13)
    torch.testing.assert_close(vp.log_probs(z, t, vocab_size=13, chunk_size=chunk), lp, rtol=0, atol=0)
    torch.testing.assert_close(vp.entropy(z, vocab_size=13, chunk_size=chunk), ent, rtol=0, atol=0)


def test_gradcheck_primitives():
    z, _, t = logits()
    z = z.requires_grad_()
    kw = dict(vocab_size=13, chunk_size=4)
    assert torch.autograd.gradcheck(lambda x: vp.log_probs(x, t, **kw), (z,))
    assert torch.autograd.gradcheck(lambda x: vp.entropy(x, **kw), (z,))
    assert torch.autograd.gradcheck(lambda x: vp.log_probs_and_entropy(x, t, **kw), (z,))


def test_padding_gets_no_gradient_and_only_one_output_may_be_used():
    z, _, t = logits()
    z = z.requires_grad_()
    lp, _ = vp.log_probs_and_entropy(z, t, vocab_size=13)
    lp.sum().backward()                                     # entropy unused: grad None inside
    assert z.grad[:, 13:].eq(0).all()
    ref = z.detach().clone().requires_grad_()
    torch.log_softmax(ref[:, :13], -1).gather(1, t[:, None]).sum().backward()
    torch.testing.assert_close(z.grad, ref.grad, rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", VOCAB_MEASURES)
def test_full_vocab_measure_matches_reference(name):
    z, zb, _ = logits(lead=(3,))
    torch.manual_seed(0)
    measure = get_divergence(name, chunk_size=2)
    torch.manual_seed(0)
    torch.testing.assert_close(measure(z, zb, vocab_size=13), reference_measure(name, z, zb, 13),
                               rtol=1e-12, atol=1e-14)
    assert (measure(z, zb, vocab_size=13) > 0).all()
    torch.testing.assert_close(measure(z, z, vocab_size=13), torch.zeros(3, 6, dtype=F64),
                               rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", VOCAB_MEASURES)
def test_gradcheck_full_vocab_measure(name):
    """Gradients to both logits, including the base's (callers detach it, but it must be right)."""
    z, zb, _ = logits(tokens=3, vocab=7, padded=9)
    measure = get_divergence(name, chunk_size=2)
    z, zb = z.requires_grad_(), zb.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, y: measure(x, y, vocab_size=7), (z, zb))
    # a detached base gets no gradient and changes nothing for the actor's
    z2 = z.detach().clone().requires_grad_()
    measure(z2, zb.detach(), vocab_size=7).sum().backward()
    measure(z, zb, vocab_size=7).sum().backward()
    torch.testing.assert_close(z2.grad, z.grad, rtol=0, atol=0)


def _prob_l2_autograd(z, zb, up, vocab):
    """D = sum_v (p_v - q_v)^2 and its gradients by autograd through torch.softmax (float64)."""
    z, zb = (x.detach().double().clone().requires_grad_() for x in (z, zb))
    d = (torch.softmax(z[..., :vocab], -1) - torch.softmax(zb[..., :vocab], -1)).square().sum(-1)
    (d * up.double()).sum().backward()
    return d.detach(), z.grad, zb.grad


@pytest.mark.parametrize("noise", [1.0, 1e-3, 1e-6])
def test_prob_l2_closed_form_equals_autograd(noise):
    """The closed-form ProbL2 pass (values, gradients to both logits, several chunks and tiles)
    against autograd through the plain formula, float64; ``noise`` sets how close the reference
    is (D up to 0.3, 5e-7, 5e-13). Observed: values <= 6.7e-16, gradients <= 9.1e-16 absolute
    (the dot products P2, PQ, Q2 err by ~eps sum p^2, whatever D is)."""
    g = torch.Generator().manual_seed(3)
    z = 3 * torch.randn(2, 11, 16, generator=g, dtype=F64)
    zb = z + noise * torch.randn(2, 11, 16, generator=g, dtype=F64)
    z[..., 13:], zb[..., 13:] = 40.0, -40.0
    up = torch.randn(2, 11, generator=g, dtype=F64)
    want = _prob_l2_autograd(z, zb, up, 13)
    for chunk, tile_rows in ((None, None), (3, 2), (1, 1)):
        measure = get_divergence("full_prob_l2", chunk_size=chunk)
        if tile_rows is not None:
            measure.tile_elements = tile_rows * 13
        x, xb = z.clone().requires_grad_(), zb.clone().requires_grad_()
        d = measure(x, xb, vocab_size=13)
        (d * up).sum().backward()
        for got, ref in ((d, want[0]), (x.grad, want[1]), (xb.grad, want[2])):
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-15)
    assert want[1].abs().max() > 1e-7                          # not a vacuous comparison


def test_prob_l2_float32_error():
    """float32 logits against the float64 formula on the same (float32) values, peaked (13
    columns, sum p^2 = 0.95) and flat (32,000) distributions, far and near (D down to 6e-8).
    D and the gradient's S = P2 - PQ come from dot products, so the error is absolute, ~eps
    sum p^2: observed <= 4.8e-7 on values, 6.1e-7 on gradients (an elementwise p - q would err
    by ~eps |p - q|: 3e-8 on these gradients, 5e-11 on D near 5e-7)."""
    g = torch.Generator().manual_seed(0)
    for noise, vocab in ((1.0, 13), (1e-3, 13), (1.0, 32000), (1e-3, 32000)):
        z = (3 * torch.randn(16, vocab, generator=g, dtype=F64)).float()
        zb = (z.double() + noise * torch.randn(16, vocab, generator=g, dtype=F64)).float()
        up = torch.randn(16, generator=g, dtype=F64)
        want = _prob_l2_autograd(z, zb, up, vocab)
        x, xb = z.clone().requires_grad_(), zb.clone().requires_grad_()
        d = get_divergence("full_prob_l2")(x, xb)
        (d * up.float()).sum().backward()
        for got, ref in ((d.detach(), want[0]), (x.grad, want[1]), (xb.grad, want[2])):
            assert float((got.double() - ref).abs().max()) <= 1.5e-6, (noise, vocab)
        assert (d >= 0).all()


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32's 10 mantissa bits (to nearest), what cuBLAS does to a matmul's
    operands when TF32 is on."""
    return ((x.contiguous().view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


def test_prob_l2_products_stay_exact_under_tf32_matmuls(monkeypatch):
    """NGC's TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 makes cuBLAS take float32 matmuls in TF32 whatever
    torch's flags say. With torch.bmm / baddbmm replaced by TF32-rounding ones, the batched-matmul
    path errs by 3.4e-4 against float64 (values and gradients, 13 and 32,000 columns), the
    elementwise path that CUDA takes (vp._elementwise_products) stays at its float32 error, 2.9e-7
    (test_prob_l2_float32_error's bound: 1.5e-6); without TF32 the two paths agree to 2.4e-7."""
    bmm, baddbmm = torch.bmm, torch.baddbmm
    g = torch.Generator().manual_seed(0)
    cases = []
    for vocab in (13, 32000):
        z = (3 * torch.randn(16, vocab, generator=g, dtype=F64)).float()
        zb = (z.double() + torch.randn(16, vocab, generator=g, dtype=F64)).float()
        up = torch.randn(16, generator=g, dtype=F64)
        cases.append((z, zb, up, _prob_l2_autograd(z, zb, up, vocab)))

    def run(elementwise: bool) -> tuple[float, list[torch.Tensor]]:
        monkeypatch.setattr(vp, "_elementwise_products", lambda device: elementwise)
        error, outputs = 0.0, []
        for z, zb, up, want in cases:
            x, xb = z.clone().requires_grad_(), zb.clone().requires_grad_()
            d = get_divergence("full_prob_l2")(x, xb)
            (d * up.float()).sum().backward()
            for got, ref in ((d.detach(), want[0]), (x.grad, want[1]), (xb.grad, want[2])):
                error = max(error, float((got.double() - ref).abs().max()))
                outputs.append(got)
        return error, outputs

    exact_matmul, matmul_out = run(elementwise=False)
    exact_elementwise, elementwise_out = run(elementwise=True)
    assert exact_matmul <= 1.5e-6 and exact_elementwise <= 1.5e-6
    for a, b in zip(matmul_out, elementwise_out):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-7)
    monkeypatch.setattr(torch, "bmm", lambda a, b, *, out=None: bmm(_tf32(a), _tf32(b), out=out))
    monkeypatch.setattr(torch, "baddbmm", lambda c, a, b, *, out=None: baddbmm(c, _tf32(a), _tf32(b), out=out))
    tf32_matmul, _ = run(elementwise=False)
    tf32_elementwise, _ = run(elementwise=True)
    assert tf32_matmul > 1e-4, tf32_matmul              # the emulation bites: what the GPU test saw
    assert tf32_elementwise <= 1.5e-6, tf32_elementwise


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("name", VOCAB_MEASURES)
def test_full_vocab_rows_outside_the_unshifted_window(name, dtype):
    """On CPU a divergence's exps are e^z unshifted, and only rows whose sum leaves the safe
    window are redone with their max. Softmax ignores a per-row constant, so rows moved far up
    or down (beside ordinary rows, in the same tiles) must give the values and gradients of the
    unmoved logits: float64 to 1e-12 relative (observed <= 6.9e-14: KL's log p = z - log Z
    rounds at ~eps |log Z|, log Z ~ 800 here); float32 (the same moved values, moved back in
    float64) to 1e-5 (observed: KL 4.1e-6, log Z ~ 120; ProbL2 5.0e-7; mirror 3.7e-8)."""
    z, zb, _ = logits(tokens=8, vocab=13, padded=13, seed=5, dtype=F64)
    far = 400.0 if dtype == F64 else 60.0
    shift = torch.tensor([0, far, -far, 0, far, 0, -far, 2 * far], dtype=F64)
    shift_b = torch.tensor([0, far, 0, -far, -far, 2 * far, 0, far], dtype=F64)
    moved, moved_b = (z + shift[:, None]).to(dtype), (zb + shift_b[:, None]).to(dtype)
    lo, hi = vp._unshifted_window(dtype, 13)
    sums = torch.stack((moved.double().exp().sum(-1), moved_b.double().exp().sum(-1)))
    outside = (sums < lo) | (sums > hi)
    assert outside[0].sum() == 5 and outside[1].sum() == 5 and not outside[:, 0].any()
    up = torch.randn(8, generator=torch.Generator().manual_seed(1), dtype=F64)
    torch.manual_seed(0)
    measure = get_divergence(name, chunk_size=3)
    measure.tile_elements = 2 * 13                              # several tiles per chunk

    def run(a, b):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        d = measure(a, b, vocab_size=13)
        (d * up.to(dtype)).sum().backward()
        return d.detach().double(), a.grad.double(), b.grad.double()

    # the reference: the same (rounded) values, moved back in float64, then the float64 pass
    ref = run(moved.double() - shift[:, None], moved_b.double() - shift_b[:, None])
    tol = 1e-12 if dtype == F64 else 1e-5
    for got, want in zip(run(moved, moved_b), ref):
        assert float((got - want).abs().max()) <= tol * max(1.0, float(want.abs().max()))
    assert ref[1].abs().max() > 1e-3


@pytest.mark.parametrize("name", VOCAB_MEASURES)
def test_full_vocab_chunks_and_tiles_do_not_change_the_result(name):
    z, zb, _ = logits(tokens=11, vocab=13, padded=16)
    results = []
    for chunk, tile_rows in ((None, None), (5, 2), (1, 1)):
        torch.manual_seed(0)
        measure = get_divergence(name, chunk_size=chunk)
        if tile_rows is not None:
            measure.tile_elements = tile_rows * 13
        x, xb = z.clone().requires_grad_(), zb.clone().requires_grad_()
        value = measure(x, xb, vocab_size=13)
        value.sum().backward()
        results.append((value.detach(), x.grad, xb.grad))
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", VOCAB_MEASURES)
def test_consume_base_reuses_the_reference_storage(name):
    z, zb, _ = logits(tokens=5, lead=(2,))
    torch.manual_seed(0)
    plain = get_divergence(name)
    torch.manual_seed(0)
    consuming = get_divergence(name, consume_base=True, chunk_size=3)
    x, y = z.clone().requires_grad_(), z.clone().requires_grad_()
    ref = zb.clone()
    want = plain(x, zb, vocab_size=13)
    got = consuming(y, ref, vocab_size=13)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(y.grad, x.grad, rtol=0, atol=1e-15)
    assert y.grad.data_ptr() == ref.data_ptr()            # no new [tokens, vocab] buffer
    with pytest.raises(ValueError, match="consume_base"):
        consuming(y, zb.clone().requires_grad_())


def test_policy_loss_and_regulariser_in_place_together():
    """The memory-lean composition of a training loss: log-probs/entropy with an in-place
    backward on the actor logits, plus full ProbL2 writing its gradient into the reference
    logits; the actor's gradient equals the out-of-place one."""
    z, zb, t = logits(tokens=7, lead=(2,))
    up = torch.randn(2, 7, dtype=F64)

    def loss(x, ref, lean):
        lp, ent = vp.log_probs_and_entropy(x, t, vocab_size=13, inplace_backward=lean)
        reg = get_divergence("full_prob_l2", consume_base=lean)(x, ref, vocab_size=13)
        return ((lp + 0.1 * ent) * up).sum() + 0.5 * reg.sum()
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    loss(a, zb.clone(), False).backward()
    loss(b, zb.clone(), True).backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_reduce_in_float32(dtype):
    z, zb, t = logits(tokens=8, vocab=500, padded=512, dtype=dtype)
    z32, zb32 = z.float().requires_grad_(), zb.float()
    zh = z.clone().requires_grad_()
    lp, ent = vp.log_probs_and_entropy(zh, t, vocab_size=500)
    lp32, ent32 = vp.log_probs_and_entropy(z32, t, vocab_size=500)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, lp32, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ent32, rtol=0, atol=1e-5)
    (lp + ent).sum().backward()
    (lp32 + ent32).sum().backward()
    assert zh.grad.dtype == dtype
    torch.testing.assert_close(zh.grad.float(), z32.grad, rtol=0, atol=1e-2)  # bf16 grad rounding
    d = get_divergence("full_prob_l2")(zh, zb, vocab_size=500)
    torch.testing.assert_close(d, get_divergence("full_prob_l2")(z32, zb32, vocab_size=500),
                               rtol=0, atol=1e-6)


def test_the_trainer_passes_bf16_logits_to_the_kernel_with_the_same_result():
    """At temperature 1 the trainer hands the bf16 logit shard to the kernel as it is (the kernel
    upcasts chunk by chunk) instead of a float32 copy of the whole shard (the upcast Float16Module
    and tempered() used to make): log-probs and entropies are the same numbers and the output
    layer's weight gradient the same bits, with no [n, V/TP] float32 copy or gradient made."""
    from megadiv.policy.megatron import tempered

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 24, 32, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 500, (1, 24), generator=g)

    def step(upcast: bool):
        weight = (0.3 * torch.randn(512, 32, generator=torch.Generator().manual_seed(4))).to(torch.bfloat16)
        weight.requires_grad_()
        logits = hidden @ weight.t()                                # [1, n, V] bf16: the output layer
        shard = logits.float() if upcast else tempered(logits, 1.0)
        assert (shard is logits) == (not upcast)                    # no copy at T = 1
        lp, ent = vp.log_probs_and_entropy(shard, targets, vocab_size=500, chunk_size=5, inplace_backward=True)
        (lp * 0.7 + 0.1 * ent).sum().backward()
        return lp, ent, weight.grad

    before, after = step(upcast=True), step(upcast=False)
    for old, new in zip(before, after):
        assert new.dtype == old.dtype and torch.equal(new, old)
    assert tempered(hidden, 0.7).dtype == torch.float32          # divided in float32 at another T


def test_inplace_backward_equals_out_of_place_and_guards_other_users():
    z, zb, t = logits(tokens=9, lead=(2,))
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    up = torch.randn(2, 9, dtype=F64)
    lp_a, ent_a = vp.log_probs_and_entropy(a, t, chunk_size=4)
    lp_b, ent_b = vp.log_probs_and_entropy(b, t, chunk_size=4, inplace_backward=True)
    ((lp_a + 0.3 * ent_a) * up).sum().backward()
    ((lp_b + 0.3 * ent_b) * up).sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-14)
    assert b.grad.data_ptr() == b.data_ptr()               # the logits' storage was reused
    # another function that saved the same logits would read overwritten values: autograd refuses
    c = z.clone().requires_grad_()
    h = c * 1.0
    # (backward runs the later-created node first: ours, after (h ** 2) has saved h)
    loss = (h ** 2).sum() + vp.log_probs(h, t, inplace_backward=True).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_extra_memory_is_bounded_by_the_chunk():
    """Forward + backward allocate the gradient (not even that in place) plus O(chunk) temporaries,
    not O(tokens x vocab) ones; the forward saves only the logits themselves."""
    z, zb, t = logits(tokens=256, vocab=1000, padded=1000, dtype=torch.float32)
    chunk, full = 8, z.nbytes
    chunk_bytes = chunk * z.shape[1] * 4

    def step(x, inplace):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda a: saved.append(a) or a, lambda a: a):
            lp, ent = vp.log_probs_and_entropy(x, t, chunk_size=chunk, inplace_backward=inplace)
        assert all(a.numel() < x.numel() or a.data_ptr() == x.data_ptr() for a in saved)
        (lp + ent).sum().backward()
    for inplace, grad_bytes in ((True, 0), (False, full)):
        x = z.clone().requires_grad_()
        assert peak_allocated_bytes(lambda x=x, inplace=inplace: step(x, inplace)) < grad_bytes + 8 * chunk_bytes
    measure = get_divergence("full_prob_l2", chunk_size=chunk)
    with torch.no_grad():
        assert peak_allocated_bytes(lambda: measure(z, zb)) < 12 * chunk_bytes
    x = z.clone().requires_grad_()
    assert peak_allocated_bytes(lambda: measure(x, zb).sum().backward()) < full + 12 * chunk_bytes


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_chunked_workspace_path_equals_unchunked(inplace):
    """Many chunks through one reused workspace give the one-chunk result: values and gradients
    of log-prob and entropy together (both upstream weights nonzero), float64."""
    z, _, t = logits(tokens=11, vocab=13, padded=16, lead=(2,))
    up_lp, up_ent = torch.randn(2, 11, dtype=F64), torch.randn(2, 11, dtype=F64)
    results = []
    for chunk in (None, 1, 3, 5):        # None: one chunk of all 22 rows
        x = z.clone().requires_grad_()
        lp, ent = vp.log_probs_and_entropy(x, t, vocab_size=13, chunk_size=chunk,
                                           inplace_backward=inplace)
        (lp * up_lp + ent * up_ent).sum().backward()
        results.append((lp.detach(), ent.detach(), x.grad))
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert results[0][2][..., :13].abs().max() > 1e-2          # not a vacuous comparison


def _large_allocations(step, row_bytes: int) -> int:
    """How many allocations of at least one logit row (``row_bytes``) ``step()`` makes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        step()
    return sum(1 for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]" and e.nbytes() >= row_bytes)


def test_chunk_temporaries_are_allocated_once_per_call():
    """The passes reuse one workspace per call: the number of row-sized (or larger) allocations
    does not grow with the number of chunks (a per-chunk temporary would add one per chunk, and
    each costs page faults when the C allocator hands freed blocks back to the OS)."""
    z, zb, t = logits(tokens=96, vocab=1000, padded=1000, dtype=torch.float32)
    up = torch.randn(96)
    row = z.shape[1] * 4

    def log_prob_entropy(chunk, inplace):
        x = z.clone().requires_grad_()
        def step():
            lp, ent = vp.log_probs_and_entropy(x, t, chunk_size=chunk, inplace_backward=inplace)
            ((lp + 0.1 * ent) * up).sum().backward()
        return _large_allocations(step, row)

    def divergence(name, chunk, consume):
        x, ref = z.clone().requires_grad_(), zb.clone()
        measure = get_divergence(name, chunk_size=chunk, consume_base=consume)
        measure.tile_elements = 2 * z.shape[1]                  # several tiles per chunk
        return _large_allocations(lambda: measure(x, ref).sum().backward(), row)

    for inplace, most in ((True, 3), (False, 4)):   # shifted/exp, probs (+ the gradient)
        counts = [log_prob_entropy(chunk, inplace) for chunk in (4, 16, 96)]
        assert counts[0] == counts[1] == counts[2] <= most, (inplace, counts)
    for name in ("full_prob_l2", "full_kl"):
        for consume, most in ((True, 4), (False, 5)):  # p, q, two tile buffers (+ the gradient)
            counts = [divergence(name, chunk, consume) for chunk in (4, 16, 96)]
            assert counts[0] == counts[1] == counts[2] <= most, (name, consume, counts)


# ----------------------------------------------------------------- TP=2 / TP=4 under torchrun

# Near the observed error (max over TP=2/4, every primitive and measure, values and gradients):
# float64 3.6e-15, float32 3.4e-6. A float32 round trip in a float64 path errs by ~1e-7 (see
# test_tolerance_catches_a_float32_round_trip), 1e6 x the float64 bound.
TOLERANCE = {"float64": 1e-13, "float32": 1e-5}


def test_tolerance_catches_a_float32_round_trip():
    """Negative control for TOLERANCE: the same primitive fed float64 logits that went through
    float32 differs from the exact one by far more than the float64 bound."""
    z, _, t = logits(tokens=64, vocab=1000, padded=1000, dtype=torch.float64)
    exact = vp.log_probs(z, t, vocab_size=1000)
    rounded = vp.log_probs(z.float().double(), t, vocab_size=1000)
    assert float((exact - rounded).abs().max()) > 1e3 * TOLERANCE["float64"]


# TP=4 is a 4-rank launch (~75 s on 2 cores): make test-all runs it, TP=2 proves the same code in make test
@pytest.fixture(scope="module", params=[pytest.param(2, id="tp2"), pytest.param(4, id="tp4", marks=pytest.mark.slow)])
def parity(request):
    ranks = run_torchrun("tests.dist.vocab_parallel:parity", request.param, timeout_s=300)
    assert [r["tp"] for r in ranks] == [request.param] * request.param
    return ranks


def test_tp_parity_covers_every_primitive_and_measure(parity):
    cases = {name for (_, _, name) in parity[0]["figures"]}
    expected = {"log_probs", "entropy", "log_probs_and_entropy", "log_probs_and_entropy/inplace",
                "naive_all_reduce_entropy"} | {f"{kind}/{n}" for n in VOCAB_MEASURES
                                               for kind in ("divergence", "consume_base")}
    assert cases == expected
    assert {(d, v) for (d, v, _) in parity[0]["figures"]} == {
        (d, v) for d in TOLERANCE for v in (1000, 1001, 700)}
    assert all(v == 1001 for (_, v, n) in parity[0]["figures"] if n.startswith(("consume", "naive")))


def test_tp_values_and_gradients_equal_tp1(parity):
    for rank in parity:
        for (dtype, vocab, name), f in rank["figures"].items():
            if name == "naive_all_reduce_entropy":
                continue
            tol = TOLERANCE[dtype]
            where = f"{name} {dtype} V={vocab}"
            assert f["value"] <= tol, where
            assert f["grad"] <= tol and f["grad_base"] <= tol, where
            assert f["grad_scale"] > 1e-3, where             # the comparison is not vacuous
            assert f["padding_grad"] == 0, where
            if name.startswith("divergence/"):
                assert f["grad_base_scale"] > 1e-3, where


def test_tp_gradient_is_nonzero_on_ranks_not_owning_the_target(parity):
    for rank in parity:
        for (dtype, vocab, name), f in rank["figures"].items():
            if name.startswith("log_probs") and f["not_owned_grad"] is not None:
                assert f["not_owned_grad"] > 1e-8, (name, dtype, vocab)


def test_plain_all_reduce_gives_wrong_gradients(parity):
    """Negative control: the same parity check catches the known trap."""
    for rank in parity:
        for (dtype, _vocab, name), f in rank["figures"].items():
            if name == "naive_all_reduce_entropy":
                assert f["value"] <= TOLERANCE[dtype]         # values are right ...
                assert f["grad"] > 1e-2                       # ... gradients are not
