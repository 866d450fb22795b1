"""The synthetic arithmetic task for small demos: ``17+25=`` -> ``42``, and its character tokenizer.

Difficulty knobs: digits per operand and number of operands. The problem sets are fixed by
``arithmetic_seed`` alone: the held-out split is drawn first, so it stays the same whatever the
training size, and the training split never contains a held-out problem.
"""
from __future__ import annotations

import random

from megadiv.data.config import DataConfig
from megadiv.data.datasets import DatasetError, DatasetSpec, Record, register_dataset

# Below this many possible problems the training split is drawn from an explicit list of the
# problems left after the held-out draw; above it, by rejection (collisions are then rare).
_ENUMERATE_LIMIT = 2_000_000


def arithmetic_problems(cfg: DataConfig, split: str) -> list[tuple[int, ...]]:
    """Operand tuples of ``split`` ('train' or 'test'), deterministic in the config's arithmetic fields."""
    base = 10 ** cfg.arithmetic_digits
    space = base ** cfg.arithmetic_operands  # problem i <-> its digits in base 10**digits
    key = f"arithmetic:{cfg.arithmetic_digits}:{cfg.arithmetic_operands}:{cfg.arithmetic_seed}"
    if cfg.arithmetic_test_size >= space:
        raise DatasetError(f"data.arithmetic_test_size={cfg.arithmetic_test_size} leaves no training problems "
                           f"out of {space}")
    test = random.Random(key + ":test").sample(range(space), cfg.arithmetic_test_size)
    if split == "test":
        chosen = test
    else:
        left = space - len(test)
        size = left if cfg.arithmetic_train_size is None else cfg.arithmetic_train_size
        if size > left:
            raise DatasetError(f"data.arithmetic_train_size={size} exceeds the {left} problems left "
                               f"after the held-out split")
        if cfg.arithmetic_train_size is None and space > _ENUMERATE_LIMIT:
            raise DatasetError(f"data.arithmetic_train_size must be set: {space} possible problems")
        rng, held_out = random.Random(key + ":train"), set(test)
        if space <= _ENUMERATE_LIMIT:
            chosen = rng.sample([i for i in range(space) if i not in held_out], size)
        else:
            chosen, seen = [], set(held_out)
            while len(chosen) < size:
                i = rng.randrange(space)
                if i not in seen:
                    seen.add(i)
                    chosen.append(i)
    return [_digits(i, base, cfg.arithmetic_operands) for i in chosen]


def _digits(i: int, base: int, n: int) -> tuple[int, ...]:
    out = []
    for _ in range(n):
        i, d = divmod(i, base)
        out.append(d)
    return tuple(out)


def load_arithmetic(cfg: DataConfig) -> list[Record]:
    records = []
    for k, ops in enumerate(arithmetic_problems(cfg, cfg.split)):
        records.append(Record(id=f"arithmetic/{cfg.split}/{k}", prompt="+".join(map(str, ops)) + "=",
                              answer=str(sum(ops))))
    return records


register_dataset("arithmetic", DatasetSpec(load_arithmetic, {"train": None, "test": None}, "none", "exact_match",
                                          "Synthetic 'a+b=' problems for small demos",
                                          eval_max_new_tokens=8))  # a sum of up to 7 digits, then EOS

ARITHMETIC_ALPHABET = "0123456789+="


def char_tokenizer(alphabet: str = ARITHMETIC_ALPHABET):
    """A Hugging Face fast tokenizer with one token per character, built offline.

    Vocabulary: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, then the alphabet in order (15 tokens for
    the arithmetic task). Encoding adds no special tokens; decoding joins characters without
    spaces. ``save_pretrained`` writes it next to a model for any engine to load.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet) or not alphabet:
        raise ValueError(f"alphabet must be non-empty with distinct characters, got {alphabet!r}")
    specials = ["<pad>", "<bos>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(alphabet))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
