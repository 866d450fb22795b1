"""Rank bodies for tests/test_smollm2.py: SmolLM2-135M-Instruct (imported from GGUF) in Megatron.

A real checkpoint where the tiny test models are random: 30 layers, hidden 576, GQA 9 heads / 3
KV heads, vocabulary 49152, tied embeddings, RoPE theta 1e5, RMSNorm eps 1e-5 (float32's
9.9999997e-06). ``ctx.args``: {"hf_dir": the imported HF directory, "tmp": scratch shared by the
ranks}. Figures are keyed "<check>/<layout>".
"""
from __future__ import annotations

import torch

from tests.dist.models import (SEQ, _export, _hf_logits, _hf_tensors, _layout, _megatron_logits, _same_tensors,
                               _shared_tmp)


def _tokens(hf_dir: str) -> torch.Tensor:
    """[2, SEQ]: a chat-templated prompt (real text) and random ids over the whole vocabulary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)[-SEQ:]
    rand = torch.randint(0, tok.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(0))
    return torch.stack([torch.tensor(prompt), rand])


def _references(hf_dir: str, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits in float32 (the reference) and float64 (the rounding-free truth that
    shows how far float32 itself is from it over 30 layers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    with torch.no_grad():
        exact = model(tokens).logits
    return _hf_logits(hf_dir, tokens), exact


def _logit_figures(results: dict, key: str, logits: torch.Tensor | None, refs: tuple, vocab: int) -> None:
    if logits is None:  # not the last pipeline stage
        return
    ref, exact = refs
    results[f"logit_diff/{key}"] = float((logits[..., :vocab] - ref).abs().max())
    results[f"logit_err_fp64/{key}"] = float((logits[..., :vocab].double() - exact).abs().max())
    results[f"hf_fp32_err_fp64/{key}"] = float((ref.double() - exact).abs().max())
    results[f"logit_scale/{key}"] = float(ref.abs().max())
    results[f"padding_cols/{key}"] = logits.shape[-1] - vocab


def two_ranks(ctx) -> dict:
    """PP=2 (15 + 15 layers): logits vs transformers, bit-exact export, and the CLI round trip
    HF -> megatron checkpoint (PP=2) -> HF; then DP=2 (TP=PP=1): each rank its own sequence."""
    from megadiv.cli import main
    from megadiv.models import build_model

    hf = ctx.args["hf_dir"]
    tokens = _tokens(hf)
    refs = _references(hf, tokens)  # [2, SEQ, 49152] each
    originals = _hf_tensors(hf)
    results: dict = {}

    _layout(1, 2)
    model = build_model(hf, role="reference")
    results[f"layers/pp2/stage{ctx.rank}"] = len(model.gpt_models[0].decoder.layers)
    results[f"tied_output_on_last_stage/pp2/stage{ctx.rank}"] = model.gpt_models[0].post_process and \
        model.gpt_models[0].share_embeddings_and_output_weights
    _logit_figures(results, "pp2", _megatron_logits(model, tokens), refs, model.vocab_size)
    exported, results["buckets/pp2"] = _export(model, 64 << 20)
    results["export_exact/pp2"] = _same_tensors(exported, originals)
    del model, exported

    tmp = _shared_tmp(ctx, "smollm2")
    mcore, back = tmp / "mcore-pp2", tmp / "hf-back"
    results["cli_rc/pp2"] = (
        main(["convert", "hf-to-megatron", "--hf-dir", hf, "--out", str(mcore), "--pp", "2"]),
        main(["convert", "megatron-to-hf", "--ckpt-dir", str(mcore), "--hf-template", hf, "--out", str(back),
              "--pp", "2"]))
    results["roundtrip_exact/pp2"] = _same_tensors(_hf_tensors(str(back)), originals)
    results["roundtrip_files/pp2"] = sorted(p.name for p in back.iterdir())

    _layout(1, 1)  # world 2: two data-parallel replicas
    model = build_model(hf, role="reference")
    row = tokens[ctx.rank:ctx.rank + 1]
    with torch.no_grad():
        logits = model.chunks[0](row, torch.arange(SEQ).unsqueeze(0), attention_mask=None)  # [1, SEQ, Vp]
    _logit_figures(results, f"dp2/rank{ctx.rank}", logits, tuple(r[ctx.rank:ctx.rank + 1] for r in refs),
                   model.vocab_size)
    return results


def three_ranks(ctx) -> dict:
    """TP=3 (3 heads / 1 KV head per rank): logits vs transformers and bit-exact export."""
    from megadiv.models import build_model

    hf = ctx.args["hf_dir"]
    tokens = _tokens(hf)
    _layout(3, 1)
    model = build_model(hf, role="reference")
    results: dict = {"padded_vocab/tp3": model.padded_vocab_size}
    logits = _megatron_logits(model, tokens)
    if ctx.rank == 0:  # every rank holds the TP-gathered logits; one compares them
        _logit_figures(results, "tp3", logits, _references(hf, tokens), model.vocab_size)
    exported, results["buckets/tp3"] = _export(model, 64 << 20)
    results["export_exact/tp3"] = _same_tensors(exported, _hf_tensors(hf))
    return results
