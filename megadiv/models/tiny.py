"""``megadiv make-tiny-model``: small random Hugging Face checkpoints with a tokenizer, offline.

    megadiv make-tiny-model --family qwen2 --out ckpt/tiny-qwen2
    # the CPU arithmetic demo's model: a character tokenizer and a Qwen2 of hidden 128
    megadiv make-tiny-model --family qwen2 --out ckpt/demo --tokenizer char \\
        --hidden 128 --layers 2 --heads 4 --kv-heads 4 --ffn 512 --tied

Every weight is random, including norm weights (around 1) and biases, so that a mapping mistake
anywhere changes the logits. The tokenizer is built with the ``tokenizers`` library: ``char``
(one token per character of --chars, the demo's choice) or ``bpe`` (byte-level BPE trained on a
short built-in text); both carry ChatML special tokens and a chat template and load with
``AutoTokenizer.from_pretrained``.

Families (TINY_FAMILIES): qwen2, qwen3, llama, qwen3_moe and qwen2_moe have Megatron mappings
(megadiv.models.families); mistral and olmo2 have none and train with ``model.backend:
deepspeed`` only (docs/deepspeed.md). qwen3_moe (a Qwen3-MoE: --experts routed experts of width
--ffn in every layer, --experts-per-token of them per token, top-k probabilities renormalised as
in Qwen3-30B-A3B) and qwen2_moe (Qwen1.5-MoE's routing, not renormalised, plus a gated shared
expert of width 2 x --ffn) are not yet ones ``warm_start.make_model`` makes (docs/models.md, MoE).

    megadiv make-tiny-model --family qwen3_moe --out ckpt/tiny-moe --experts 8 --experts-per-token 2
"""
from __future__ import annotations

import shutil
import string
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
DEFAULT_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_BPE_TEXT = """\
Question: what is 17 + 25? Answer: 17 + 25 = 42. The answer is 42.
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May? 48 / 2 = 24. 48 + 24 = 72. #### 72
def add(a, b):\n    return a + b\n
The quick brown fox jumps over the lazy dog. A policy gradient step moves the model toward
rewarded answers; the reference model stays fixed. Let x = 3 and y = 4, then x * y = 12.
"""


@dataclass(frozen=True)
class TinyFamily:
    """How to write a random checkpoint of one HF ``model_type`` beyond the fields all share."""

    tied: bool
    """Default of tie_word_embeddings: what the family's released checkpoints do."""
    config: Callable[[dict, dict], dict] = field(default=lambda kwargs, options: {})
    """(shared config kwargs, family options: llama3_rope_factor, experts, experts_per_token) -> the
    family's own config kwargs."""
    warm_start: bool = True
    """``megadiv train`` can make it (``warm_start.make_model``)."""


def _llama3_rope(kwargs: dict, options: dict) -> dict:
    factor = options["llama3_rope_factor"]
    if not factor:
        return {}
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    # Llama 3.1 style: the scaled context is factor x the original 8192
    return {"rope_scaling": scaling, "max_position_embeddings": max(kwargs["max_position_embeddings"], int(8192 * factor))}


def _mistral(kwargs: dict, _options: dict) -> dict:
    # MistralConfig defaults head_dim to 128 whatever the width; Mistral 7B v0.2+ has no sliding window
    return {"head_dim": kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"],
            "sliding_window": None}


def _routed_experts(kwargs: dict, options: dict, norm_topk_prob: bool, shared_expert: bool = False) -> dict:
    """Every layer a MoE layer of --experts experts of width --ffn; with ``shared_expert`` one of
    twice that width beside them (Qwen1.5-MoE's is four times)."""
    experts, topk = options["experts"], options["experts_per_token"]
    if not 1 <= topk <= experts:
        raise ValueError(f"--experts-per-token {topk} must be in 1..--experts {experts}")
    shared = {"shared_expert_intermediate_size": 2 * kwargs["intermediate_size"]} if shared_expert else {}
    return {"num_experts": experts, "num_experts_per_tok": topk, "moe_intermediate_size": kwargs["intermediate_size"],
            "norm_topk_prob": norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [], **shared}


TINY_FAMILIES: dict[str, TinyFamily] = {
    "qwen2": TinyFamily(tied=True),
    "qwen3": TinyFamily(tied=True),
    "llama": TinyFamily(tied=False, config=_llama3_rope),
    # no Megatron mapping: DeepSpeed backend only
    "mistral": TinyFamily(tied=False, config=_mistral),
    "olmo2": TinyFamily(tied=False),  # post-norm blocks, RMSNorm over the whole q and k projections
    "qwen3_moe": TinyFamily(tied=False, config=partial(_routed_experts, norm_topk_prob=True), warm_start=False),
    # Qwen1.5-MoE's routing: the top-k of the softmax over all experts, not renormalised
    "qwen2_moe": TinyFamily(tied=False, config=partial(_routed_experts, norm_topk_prob=False, shared_expert=True),
                            warm_start=False),
}
FAMILIES = tuple(TINY_FAMILIES)


def make_tiny_model(out: str | Path, family: str, tokenizer: str = "char", chars: str = DEFAULT_CHARS,
                    vocab: int | None = None, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    head_dim: int | None = None, ffn: int = 128, tied: bool | None = None,
                    rope_theta: float = 10000.0, llama3_rope_factor: float = 8.0, max_positions: int = 512,
                    init_std: float = 0.05, dtype: str = "float32", max_shard_size: str | None = None,
                    seed: int = 0, replace: bool = False, experts: int = 4, experts_per_token: int = 2) -> Path:
    """Write a random ``family`` checkpoint plus tokenizer to ``out`` (atomically) and return it.
    An existing ``out`` is an error (FileExistsError), or with ``replace`` is swapped for the new one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    if out.exists() and not replace:
        raise FileExistsError(f"{out} exists: choose a new directory, or pass --force to replace it")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    tok = build_tokenizer(tokenizer, chars=chars, bpe_vocab=vocab or 320)
    vocab = vocab or len(tok)
    if vocab < len(tok):
        raise ValueError(f"--vocab {vocab} is smaller than the tokenizer ({len(tok)} tokens)")
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        rms_norm_eps=1e-6, initializer_range=init_std,
        tie_word_embeddings=TINY_FAMILIES[family].tied if tied is None else tied,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    options = {"llama3_rope_factor": llama3_rope_factor, "experts": experts, "experts_per_token": experts_per_token}
    kwargs |= TINY_FAMILIES[family].config(kwargs, options)
    config = AutoConfig.for_model(family, rope_theta=rope_theta, **kwargs)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # around 1, not exactly 1: a swapped norm must change the output
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # MoE router: HF starts it at zero (every expert tied)
                p.copy_(init_std * torch.randn_like(p))
            elif name.endswith(".bias"):  # HF initialises biases to zero
                p.copy_(init_std * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        save = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(tmp, **save)
        tok.save_pretrained(tmp)
        if replace and out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def build_tokenizer(kind: str, chars: str = DEFAULT_CHARS, bpe_vocab: int = 320):
    """A transformers fast tokenizer with ChatML special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Both kinds are byte-level BPE (Qwen's and Llama 3's scheme): transformers 5 rebuilds Qwen
    # tokenizers from the vocabulary and merges with its own byte-level pipeline, so anything
    # else would not survive AutoTokenizer.from_pretrained.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if kind == "char":  # one token per character of the alphabet: byte-level symbols, no merges
        symbols = list(dict.fromkeys(byte_level.pre_tokenize_str(c)[0][0] for c in chars))
        if any(len(s) != 1 for s in symbols):
            raise ValueError("the char tokenizer takes single-byte (ASCII) characters only")
        vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + symbols)}
        core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    elif kind == "bpe":
        core = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        core.pre_tokenizer = byte_level
        core.train_from_iterator([_BPE_TEXT], trainer)
    else:
        raise ValueError(f"tokenizer must be 'char' or 'bpe', got {kind!r}")
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", bos_token=None,
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok
