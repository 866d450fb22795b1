"""Single-process tests of megadiv.models: config parsing, weight tables, TP layout maths,
bucketing, the tiny-model maker and the convert CLI's argument checks (no process groups)."""
import math

import pytest
import torch

from megadiv.config import ConfigError, ModelConfig
from megadiv.models.families import FAMILIES, arch_from_hf_config, plan
from megadiv.models.hf_config import ArchSpec
from megadiv.models.sharding import Layout, padded_vocab_size, shard, stage_layer_counts, unshard

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100, "rms_norm_eps": 1e-5}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# --------------------------------------------------------------------------- config.json


def test_transformers_4_and_5_spellings_agree():
    v4 = arch_from_hf_config({**BASE, "model_type": "llama", "rope_theta": 500000.0, "torch_dtype": "bfloat16",
                              "rope_scaling": {"rope_type": "llama3", **LLAMA3}, "tie_word_embeddings": False})
    v5 = arch_from_hf_config({**BASE, "model_type": "llama", "dtype": "bfloat16", "tie_word_embeddings": False,
                              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}})
    old_key = arch_from_hf_config({**BASE, "model_type": "llama", "rope_theta": 500000.0, "torch_dtype": "bfloat16",
                                   "rope_scaling": {"type": "llama3", **LLAMA3}, "tie_word_embeddings": False})
    assert v4 == v5 == old_key
    assert (v5.rope_theta, v5.rope_scaling_factor, v5.dtype, v5.rms_norm_eps) == (500000.0, 8.0, "bfloat16", 1e-5)


def test_qwen_config_fields():
    q2 = arch_from_hf_config({**BASE, "model_type": "qwen2", "rope_parameters": {"rope_type": "default",
                                                                                  "rope_theta": 1e6}})
    assert (q2.rope_theta, q2.rope_scaling_factor, q2.tie_word_embeddings) == (1e6, None, True)  # tied by default
    assert (q2.head_dim, q2.num_query_groups, q2.heads_per_group) == (16, 2, 2)
    q3 = arch_from_hf_config({**BASE, "model_type": "qwen3", "head_dim": 32, "rope_theta": 1e6})
    assert q3.head_dim == 32  # Qwen3 sets head_dim independently of hidden / heads


@pytest.mark.parametrize("extra,message", [
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling type 'yarn'"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, **LLAMA3,
                                                 "low_freq_factor": 2.0}}, "low_freq_factor=2.0"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_configs_are_refused_by_name(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        arch_from_hf_config({**BASE, **extra})


# --------------------------------------------------------------------------- weight tables


@pytest.mark.parametrize("family,extra", [
    ("qwen2", {}), ("qwen3", {"head_dim": 32}), ("llama", {"tie_word_embeddings": False})])
def test_plan_names_and_shapes_equal_transformers_state_dict(family, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(family, **{k: v for k, v in BASE.items()}, **extra)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")  # save_pretrained writes tied weights once
    arch = arch_from_hf_config(hf_cfg.to_dict())
    assert {t.hf_name: t.shape for t in plan(arch)} == expected


def test_plan_order_is_layer_by_layer():
    arch = arch_from_hf_config({**BASE, "model_type": "qwen2", "tie_word_embeddings": False})
    names = [t.hf_name for t in plan(arch)]
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers)


# --------------------------------------------------------------------------- TP layout maths


def _arch(**kw) -> ArchSpec:
    fields = dict(family="qwen2", num_layers=2, hidden_size=12, num_attention_heads=8, num_query_groups=4,
                  head_dim=3, ffn_hidden_size=8, vocab_size=10, max_position_embeddings=64, rope_theta=1e4,
                  rope_scaling_factor=None, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32")
    return ArchSpec(**{**fields, **kw})


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_shard_is_megatron_group_interleaving(tp, bias):
    arch = _arch()  # 8 heads in 4 groups of 2, head_dim 3
    d, hpg, groups = arch.head_dim, arch.heads_per_group, arch.num_query_groups
    tail = () if bias else (arch.hidden_size,)
    q = torch.randn(groups * hpg * d, *tail)
    k, v = torch.randn(groups * d, *tail), torch.randn(groups * d, *tail)
    shards = [shard(Layout.QKV, [q, k, v], r, tp, arch, 16) for r in range(tp)]
    for r, s in enumerate(shards):  # rank r: [q_g; k_g; v_g] for each of its groups g, in order
        own = range(r * groups // tp, (r + 1) * groups // tp)
        expected = torch.cat([torch.cat([q[g * hpg * d:(g + 1) * hpg * d], k[g * d:(g + 1) * d],
                                         v[g * d:(g + 1) * d]]) for g in own])
        assert torch.equal(s, expected)
    assert all(torch.equal(a, b) for a, b in zip(unshard(Layout.QKV, shards, arch), [q, k, v]))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_shard_is_per_rank_gate_then_up(tp):
    arch = _arch()
    gate, up = torch.randn(8, 12), torch.randn(8, 12)
    shards = [shard(Layout.GATE_UP, [gate, up], r, tp, arch, 16) for r in range(tp)]
    n = 8 // tp
    for r, s in enumerate(shards):
        assert torch.equal(s, torch.cat([gate[r * n:(r + 1) * n], up[r * n:(r + 1) * n]]))
    assert all(torch.equal(a, b) for a, b in zip(unshard(Layout.GATE_UP, shards, arch), [gate, up]))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_shard_pads_with_zero_rows(tp):
    arch = _arch(vocab_size=10)
    padded = padded_vocab_size(10, tp, multiple=8)  # 16 rows: with tp=4 the last rank holds only padding
    emb = torch.randn(10, 12)
    shards = [shard(Layout.VOCAB, [emb], r, tp, arch, padded) for r in range(tp)]
    full = torch.cat(shards)
    assert full.shape == (16, 12) and torch.equal(full[:10], emb) and not full[10:].any()
    assert torch.equal(unshard(Layout.VOCAB, shards, arch)[0], emb)


@pytest.mark.parametrize("layout,dim", [(Layout.COLUMN, 0), (Layout.ROW, 1)])
def test_row_and_column_shards(layout, dim):
    arch = _arch()
    w = torch.randn(8, 12)
    shards = [shard(layout, [w], r, 4, arch, 16) for r in range(4)]
    assert all(torch.equal(s, c) for s, c in zip(shards, w.chunk(4, dim=dim)))
    assert torch.equal(unshard(layout, shards, arch)[0], w)


def test_shard_reads_safetensors_slices(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    arch = _arch()
    tensors = {"q": torch.randn(24, 12), "k": torch.randn(12, 12), "v": torch.randn(12, 12), "o": torch.randn(12, 24)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for r in range(2):
            lazy = shard(Layout.QKV, [f.get_slice(n) for n in "qkv"], r, 2, arch, 16)
            assert torch.equal(lazy, shard(Layout.QKV, [tensors[n] for n in "qkv"], r, 2, arch, 16))
            assert torch.equal(shard(Layout.ROW, [f.get_slice("o")], r, 2, arch, 16), tensors["o"].chunk(2, 1)[r])


def test_padded_vocab_size_is_the_same_for_power_of_two_tp():
    assert [padded_vocab_size(100, tp) for tp in (1, 2, 4, 8)] == [128] * 4
    assert padded_vocab_size(151936, 8) == 151936  # Qwen2.5's 151936 = 1187 * 128
    assert padded_vocab_size(129, 2) == 256
    assert padded_vocab_size(49152, 3) % 3 == 0 and padded_vocab_size(100, 3) == math.lcm(128, 3)


def test_stage_layer_counts():
    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(3, 2) == [1, 2]
    assert stage_layer_counts(30, 4) == [7, 8, 8, 7]
    assert stage_layer_counts(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(ValueError, match="equal middle stages"):
        stage_layer_counts(6, 4, [1, 2, 1, 2])
    with pytest.raises(ValueError, match=">= 1 layer per stage"):
        stage_layer_counts(5, 4)


def test_buckets_never_split_a_fused_parameter():
    from megadiv.models.export import _buckets

    arch = arch_from_hf_config({**BASE, "model_type": "qwen2"})
    planned = plan(arch)
    buckets = list(_buckets(planned, 40_000, 4))
    assert [t for b in buckets for t in b] == planned
    for b in buckets:
        size = sum(4 * math.prod(t.shape) for t in b)
        assert size <= 40_000 or len({t.megatron_name for t in b}) == 1
    starts = {b[0].hf_name for b in buckets}
    assert not any(n.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")) for n in starts)


# --------------------------------------------------------------------------- builder pieces


def test_transformer_config_reproduces_the_architecture():
    from megadiv.models.builder import transformer_config

    arch = arch_from_hf_config({**BASE, "model_type": "qwen3", "head_dim": 32, "num_hidden_layers": 3})
    cfg = transformer_config(arch, FAMILIES["qwen3"], ModelConfig(), tp=1, pp=2, vpp=None, sequence_parallel=False,
                             stage_layers=[1, 2], initialize=True)
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.qk_layernorm, cfg.add_qkv_bias) == (2, 32, True, False)
    assert (cfg.normalization, cfg.layernorm_epsilon, cfg.gated_linear_unit) == ("RMSNorm", 1e-5, True)
    assert (cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage) == (1, 2)
    assert cfg.activation_func is torch.nn.functional.silu and not cfg.add_bias_linear


def test_transformer_engine_spec_without_te_is_a_clear_error():
    from megatron.core.models.gpt import gpt_layer_specs

    from megadiv.models.builder import _resolve_impl, layer_spec

    if gpt_layer_specs.HAVE_TE:
        pytest.skip("Transformer Engine is installed")
    for family, experts in (("qwen2", None), ("qwen3_moe", 8)):
        with pytest.raises(ConfigError, match="needs Transformer Engine"):
            layer_spec(FAMILIES[family], "transformer_engine", experts)
    with pytest.raises(ConfigError, match="needs Transformer Engine on a GPU"):
        _resolve_impl(ModelConfig(fp8="tensorwise"))
    assert _resolve_impl(ModelConfig()) == "local"


# --------------------------------------------------------------------------- tiny maker and CLI


def test_tiny_demo_model_and_char_tokenizer(tmp_path):
    import json

    from transformers import AutoTokenizer

    from megadiv.models.tiny import make_tiny_model

    out = make_tiny_model(tmp_path / "demo", "qwen2", tokenizer="char", hidden=128, layers=2, heads=4, kv_heads=4,
                          ffn=512, tied=True)
    cfg = json.loads((out / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["intermediate_size"],
            cfg["tie_word_embeddings"], cfg["vocab_size"]) == (128, 2, 4, 512, True, len(tok))
    text = "12+30=42\nThe answer is 42."
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text  # one token per character
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and cfg["eos_token_id"] == tok.eos_token_id
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # no partial directory left
    with pytest.raises(FileExistsError):
        make_tiny_model(out, "qwen2")


def test_tiny_bpe_tokenizer_round_trips(tmp_path):
    from transformers import AutoTokenizer

    from megadiv.models.tiny import make_tiny_model

    out = make_tiny_model(tmp_path / "llama", "llama", tokenizer="bpe", vocab=300)
    tok = AutoTokenizer.from_pretrained(out)
    text = "Natalia sold 48 clips; unseen words like zygote still encode."
    assert tok.decode(tok(text)["input_ids"]) == text and len(tok) == 300


@pytest.mark.parametrize("family", ["mistral", "olmo2"])
def test_tiny_families_without_megatron_mapping(tmp_path, family):
    """The DeepSpeed-only families load as their own HF classes, with the demo's char tokenizer and
    every norm weight random (a swapped norm would change the logits); megatron's mapping refuses them."""
    import json
    from typing import get_args, get_type_hints

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megadiv.models.families import FAMILIES as MEGATRON_FAMILIES
    from megadiv.models.families import arch_from_hf_config
    from megadiv.models.tiny import TINY_FAMILIES, make_tiny_model
    from megadiv.trainer.config import WarmStartConfig

    makes = tuple(name for name, tiny in TINY_FAMILIES.items() if tiny.warm_start)
    assert get_args(get_type_hints(WarmStartConfig)["make_model"]) == ("none", *makes)
    assert family not in MEGATRON_FAMILIES
    out = make_tiny_model(tmp_path / family, family, tokenizer="char", chars="0123456789+=", hidden=32, heads=4,
                          kv_heads=2, ffn=64)
    cfg = json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__.lower() == f"{family}forcausallm"
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (32, 32)  # head_dim = hidden / heads
    assert not cfg["tie_word_embeddings"] and len(tok) == cfg["vocab_size"] == 4 + 12
    assert tok.decode(tok("12+30=42")["input_ids"]) == "12+30=42"
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(not torch.equal(p, torch.ones_like(p)) for p in norms)
    with pytest.raises(ConfigError, match=f"model_type '{family}'"):
        arch_from_hf_config(cfg)


def test_parse_size():
    from megadiv.models.convert import parse_size

    assert parse_size("2GB") == 2 << 30 and parse_size("100KB") == 100 << 10 and parse_size("512MiB") == 512 << 20
    assert parse_size("4096") == 4096
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_convert_needs_tp_times_pp_processes(monkeypatch):
    import torch.distributed as dist

    from megadiv.models.convert import _start

    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="needs 4 processes, this run has 1.*torchrun --nproc-per-node 4"):
        _start(2, 2, 1, False)
