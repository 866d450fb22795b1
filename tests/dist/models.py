"""Rank bodies for tests/test_models_dist.py: megadiv's Megatron models against Hugging Face.

One body per world size (1, 2, 4 ranks); each switches through several TP x PP layouts in one
launch and returns a dict of figures keyed "<check>/<family>/<layout>" for the tests to assert.
``ctx.args``: {"models": {name: hf_dir}, "tmp": scratch dir shared by the ranks}.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

BATCH, SEQ = 2, 24
FAMILIES = ("qwen2", "qwen3", "llama")


# --------------------------------------------------------------------------- helpers


def _layout(tp: int, pp: int, vpp: int | None = None):
    """(Re)build megatron's parallel state for TP x PP (x VPP), keeping the default group."""
    from megadiv.config import ParallelConfig
    from megadiv.parallel import initialize, shutdown

    shutdown(keep_default_group=True)
    return initialize(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline=vpp))


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits  # [b, s, V]


def _hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """Forward through megatron's pipeline schedule (one micro-batch per sequence); returns
    [b, s, Vp] gathered over TP on the last stage, None on other stages."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(SEQ).unsqueeze(0)

    def forward_step(data_iterator, chunk):
        output = chunk(next(data_iterator), positions, attention_mask=None)  # [1, s, Vp/tp] on the last stage

        def keep(out):
            return out.new_zeros(()), {"logits": out.detach()}
        return output, keep

    micro = [tokens[i:i + 1] for i in range(BATCH)]
    iterators = [iter(micro) for _ in model.chunks] if len(model.chunks) > 1 else iter(micro)
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators, model=model.chunks,
            num_microbatches=BATCH, seq_length=SEQ, micro_batch_size=1, forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(torch.cat([o["logits"] for o in out]))


def _export(model, bucket_bytes: int) -> tuple[dict[str, torch.Tensor], int]:
    from megadiv.models.export import iter_hf_weight_buckets

    tensors, buckets = {}, 0
    for bucket in iter_hf_weight_buckets(model, bucket_bytes):
        buckets += 1
        for name, t in bucket:
            assert name not in tensors, f"{name} exported twice"
            tensors[name] = t
    return tensors, buckets


def _same_tensors(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _check_model(ctx, family: str, layout: str, results: dict, bucket_bytes: int = 16 << 10, **build) -> None:
    """Logits vs HF and bit-exact export for one family at the current layout."""
    from megadiv.models import build_model

    hf_dir = ctx.args["models"][family]
    model = build_model(hf_dir, role="reference", **build)
    tokens = _tokens(model.vocab_size)
    logits = _megatron_logits(model, tokens)
    key = f"{family}/{layout}"
    if logits is not None:
        ref = _hf_logits(hf_dir, tokens)
        results[f"logit_diff/{key}"] = float((logits[..., :model.vocab_size] - ref).abs().max())
        results[f"padding_cols/{key}"] = logits.shape[-1] - model.vocab_size
        results[f"padding_logit_max/{key}"] = float(logits[..., model.vocab_size:].abs().max()) \
            if logits.shape[-1] > model.vocab_size else 0.0
    exported, buckets = _export(model, bucket_bytes)
    results[f"export_exact/{key}"] = _same_tensors(exported, _hf_tensors(hf_dir))
    results[f"buckets/{key}"] = buckets
    if layout == "tp1":  # the embedded engine's shared weights: the export's values, views where possible
        from megadiv.models.export import hf_weight_views

        views = dict(hf_weight_views(model))
        storage = {p.untyped_storage().data_ptr() for p in model.gpt_models[0].parameters()}
        results[f"views_exact/{key}"] = _same_tensors(views, exported)
        results[f"view_copies/{key}"] = sorted(n for n, t in views.items() if t.untyped_storage().data_ptr() not in storage)
        results[f"export_aliases/{key}"] = any(t.untyped_storage().data_ptr() in storage for t in exported.values())
        results[f"query_groups/{key}"] = model.arch.num_query_groups


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # the tests check type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _shared_tmp(ctx, name: str) -> Path:
    path = Path(ctx.args["tmp"]) / name
    if ctx.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


# --------------------------------------------------------------------------- bodies


def one_rank(ctx) -> dict:
    """TP=1: logits and export of every family, llama3 RoPE frequencies, reference freezing,
    checkpoint validation errors, and the CLI round trip."""
    from megadiv.models import build_model
    from megadiv.models.loading import load_hf_weights

    _layout(1, 1)
    results: dict = {}
    for family in FAMILIES + ("gqa1",):  # gqa1: one query group, q/k/v views of linear_qkv too
        _check_model(ctx, family, "tp1", results)

    # Llama-3 RoPE scaling: megatron's inverse frequencies equal transformers' for this config
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    llama = build_model(ctx.args["models"]["llama"], role="reference")
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(ctx.args["models"]["llama"]), "cpu")
    mine = llama.gpt_models[0].rotary_pos_emb.inv_freq
    results["llama3_inv_freq_diff"] = float((mine - hf_inv_freq).abs().max())
    results["llama3_scaled_freqs"] = int((hf_inv_freq != 1.0 / (10000.0 ** (torch.arange(0, 16, 2) / 16))).sum())
    results["reference_frozen"] = all(not p.requires_grad for p in llama.gpt_models[0].parameters()) \
        and not llama.gpt_models[0].training
    actor = build_model(ctx.args["models"]["llama"], role="actor")
    results["actor_trainable"] = all(p.requires_grad for p in actor.gpt_models[0].parameters())

    # a broken checkpoint stops the load with the tensor's name and both shapes
    from safetensors.torch import load_file, save_file

    tmp = _shared_tmp(ctx, "broken")
    src = Path(ctx.args["models"]["qwen2"])
    for case in ("missing", "extra", "shape"):
        d = tmp / case
        shutil.copytree(src, d)
        sd = load_file(str(d / "model.safetensors"))
        if case == "missing":
            del sd["model.layers.1.self_attn.k_proj.bias"]
        elif case == "extra":
            sd["model.layers.1.mlp.extra.weight"] = torch.zeros(3)
        else:
            sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(129, 64)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        model = build_model(src, role="reference", load_weights=False)
        results[f"error/{case}"] = _error(lambda: load_hf_weights(model, d))

    # CLI round trip at TP=1 through megadiv.cli (inside this running job)
    from megadiv.cli import main

    mc, hf_out = tmp / "mcore", tmp / "hf"
    results["cli_to_mcore_rc"] = main(["convert", "hf-to-megatron", "--hf-dir", ctx.args["models"]["llama"],
                                       "--out", str(mc)])
    results["cli_to_hf_rc"] = main(["convert", "megatron-to-hf", "--ckpt-dir", str(mc), "--hf-template",
                                    ctx.args["models"]["llama"], "--out", str(hf_out), "--shard-size", "64KB"])
    results["cli_roundtrip_exact"] = _same_tensors(_hf_tensors(str(hf_out)), _hf_tensors(ctx.args["models"]["llama"]))
    results["cli_out_files"] = sorted(p.name for p in hf_out.iterdir())
    results["cli_partial_left"] = sorted(p.name for p in tmp.iterdir() if p.name.endswith(".partial"))
    results["cli_exists_rc"] = main(["convert", "megatron-to-hf", "--ckpt-dir", str(mc), "--hf-template",
                                     ctx.args["models"]["llama"], "--out", str(hf_out)])
    results["cli_bad_world_rc"] = main(["convert", "hf-to-megatron", "--hf-dir", ctx.args["models"]["llama"],
                                        "--out", str(tmp / "x"), "--tp", "2"])
    return results


def two_ranks(ctx) -> dict:
    """TP=2 and PP=2 (uneven for the 3-layer qwen3): logits and export; GQA and vocab checks."""
    from megadiv.models import build_model

    results: dict = {}
    _layout(2, 1)
    for family in FAMILIES:
        _check_model(ctx, family, "tp2", results)
    results["error/gqa_tp2"] = _error(lambda: build_model(ctx.args["models"]["gqa1"], role="reference"))
    _layout(1, 2)
    for family in FAMILIES:
        _check_model(ctx, family, "pp2", results)
    _check_model(ctx, "llama", "pp2_stages_1_3", results, stage_layers=[1, 3])
    results["layers_per_stage/qwen3"] = len(build_model(ctx.args["models"]["qwen3"], role="reference")
                                            .gpt_models[0].decoder.layers)
    return results


def four_ranks(ctx) -> dict:
    """TP=2 x PP=2 logits and export, the CLI round trip at TP=2 x PP=2, checkpoints resharded
    TP2xPP2 -> TP1 and TP1 -> TP2xPP2, and interleaved (virtual) pipeline stages."""
    from megadiv.cli import main
    from megadiv.models import build_model, load_megatron_checkpoint, save_megatron_checkpoint

    results: dict = {}
    hf = ctx.args["models"]
    _layout(2, 2)
    tmp = _shared_tmp(ctx, "four")
    for family in FAMILIES:
        _check_model(ctx, family, "tp2pp2", results)
    tokens = _tokens(101)
    tp2pp2 = build_model(hf["llama"], role="reference")
    logits_tp2pp2 = _megatron_logits(tp2pp2, tokens)

    # HF -> megatron (TP2 x PP2) -> HF, through the CLI
    for family in ("qwen2", "llama"):
        mc, out = tmp / f"{family}-mcore", tmp / f"{family}-hf"
        rc1 = main(["convert", "hf-to-megatron", "--hf-dir", hf[family], "--out", str(mc), "--tp", "2", "--pp", "2"])
        rc2 = main(["convert", "megatron-to-hf", "--ckpt-dir", str(mc), "--hf-template", hf[family], "--out", str(out),
                    "--tp", "2", "--pp", "2", "--shard-size", "100KB"])
        results[f"cli_rc/{family}"] = (rc1, rc2)
        results[f"roundtrip_exact/{family}"] = _same_tensors(_hf_tensors(str(out)), _hf_tensors(hf[family]))

    # written at TP2 x PP2 (by the CLI above), loaded at TP1: same logits as built from HF at TP1
    _layout(1, 1)
    from_ckpt = build_model(hf["llama"], role="reference", load_weights=False)
    load_megatron_checkpoint(from_ckpt, tmp / "llama-mcore")
    from_hf = build_model(hf["llama"], role="reference")
    a, b = _megatron_logits(from_ckpt, tokens), _megatron_logits(from_hf, tokens)
    results["tp2pp2_to_tp1_bitwise"] = bool(torch.equal(a, b))
    if logits_tp2pp2 is not None:
        results["tp2pp2_vs_tp1_diff"] = float((logits_tp2pp2 - a).abs().max())
    save_megatron_checkpoint(from_hf, tmp / "llama-tp1")  # 4 data-parallel replicas write one checkpoint

    # written at TP1, loaded at TP2 x PP2
    _layout(2, 2)
    resharded = build_model(hf["llama"], role="reference", load_weights=False)
    load_megatron_checkpoint(resharded, tmp / "llama-tp1")
    c = _megatron_logits(resharded, tokens)
    if c is not None:
        results["tp1_to_tp2pp2_bitwise"] = bool(torch.equal(c, logits_tp2pp2))

    # interleaved pipeline: PP=2 x VPP=2 (4 layers: one per virtual stage) with TP=2
    _layout(2, 2, vpp=2)
    _check_model(ctx, "llama", "tp2pp2vpp2", results)
    return results


# --------------------------------------------------------------------------- fixtures


def make_test_models(root: Path) -> dict[str, str]:
    """The tiny checkpoints the model tests use (float32, random, a few hundred KB each):

    - qwen2: char tokenizer (100 tokens), tied embeddings, 4 heads / 2 KV heads, QKV bias
    - qwen3: byte-level BPE tokenizer (320), 3 layers (uneven PP=2), head_dim 32 != 64/4, QK norm
    - llama: 101-row vocabulary (not a multiple of TP), untied, Llama-3 RoPE scaling, 4 layers,
      safetensors split over several files
    - gqa1: qwen2 with a single KV head (TP=2 must be refused)
    """
    from megadiv.models.tiny import make_tiny_model

    specs = {
        "qwen2": dict(family="qwen2"),
        "qwen3": dict(family="qwen3", tokenizer="bpe", layers=3, head_dim=32),
        "llama": dict(family="llama", vocab=101, layers=4, max_shard_size="100KB"),
        "gqa1": dict(family="qwen2", kv_heads=1),
    }
    return {name: str(make_tiny_model(root / name, **spec)) for name, spec in specs.items()}


def te_fp8_vs_bf16(ctx) -> dict:
    """GPU, one rank: the Transformer Engine spec (bf16, then FP8) against megatron's local spec
    in bf16, on the same HF weights. Figures: relative L2 error ||L - L_ref|| / ||L_ref|| of the
    true-vocabulary logits, and the max abs difference of log-softmax."""
    from megadiv.config import ModelConfig
    from megadiv.models import build_model

    _layout(1, 1)
    hf_dir = ctx.args["models"]["fp8"]
    tokens = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(64, device="cuda").unsqueeze(0)

    def logits(**model_cfg) -> torch.Tensor:
        model = build_model(ModelConfig(hf_dir=hf_dir, params_dtype="bfloat16", **model_cfg), role="reference")
        with torch.no_grad():
            out = model.chunks[0](tokens, positions, attention_mask=None)  # [b, s, Vp] float32 (Float16Module)
        return out[..., :model.vocab_size].float()

    ref = logits(transformer_impl="local")
    results = {}
    for name, cfg in {"te_bf16": dict(transformer_impl="transformer_engine"),
                      "te_fp8": dict(transformer_impl="transformer_engine", fp8="tensorwise")}.items():
        out = logits(**cfg)
        results[f"rel_l2/{name}"] = float((out - ref).norm() / ref.norm())
        results[f"logprob_max_abs/{name}"] = float((out.log_softmax(-1) - ref.log_softmax(-1)).abs().max())
    return results
