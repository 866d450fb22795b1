"""Graded arithmetic word problems: one short story, one operation, a whole-number answer.

"Mia has 64 stickers. She gives 28 of them to a friend. How many stickers does Mia have now?" -> 36

For small pretrained models (the SmolLM2-135M recipe): hard enough that they often get it wrong,
easy enough that RL can move them. Three levels of difficulty, drawn in equal shares:

- ``add``: a + b, both operands with ``arithmetic_digits`` digits (two: 10..99);
- ``sub``: a - b with a > b, both with that many digits (the answer is positive);
- ``mul``: a x b, a multiplier in 2..12 times an operand with that many digits.

The problem sets are fixed by ``arithmetic_seed`` alone, like the synthetic ``arithmetic`` task: the
held-out split is drawn first, so it stays the same whatever the training size (and its first N
problems are the held-out split of ``arithmetic_test_size=N``), and no training
problem has the same operation and operands as a held-out one (the story may differ, the sum
may not). Record ids carry the level (``word_arithmetic/test/17/sub``), so accuracy can be split
by level. ``arithmetic_operands`` must stay 2 (each story has two numbers).
"""
from __future__ import annotations

import random

from megadiv.data.config import DataConfig
from megadiv.data.datasets import DatasetError, DatasetSpec, Record, register_dataset

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Ben", "Lily", "Max", "Nora", "Eli")
THINGS = ("apples", "stickers", "marbles", "pencils", "cookies", "stamps", "shells", "cards", "books", "coins")
CONTAINERS = ("boxes", "bags", "jars", "baskets", "shelves", "packs")

# {n}: a name, {t}: a plural noun, {c}: a plural container; {a}, {b}: the operands.
STORIES = {
    "add": ("{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?",
            "There are {a} {t} in a box and {b} {t} on the table. How many {t} are there in all?",
            "{n} collected {a} {t} on Monday and {b} {t} on Tuesday. How many {t} did {n} collect in total?"),
    "sub": ("{n} has {a} {t}. {n} gives away {b} of them. How many {t} does {n} have left?",
            "There were {a} {t} in a box. {n} took {b} {t} out. How many {t} are still in the box?",
            "{n} needs {a} {t} and already has {b}. How many more {t} does {n} need?"),
    "mul": ("{n} has {a} {c} with {b} {t} in each. How many {t} does {n} have?",
            "There are {a} {c}, and each holds {b} {t}. How many {t} are there altogether?",
            "{n} buys {a} {c} of {t}. Each one has {b} {t}. How many {t} did {n} buy?"),
}
LEVELS = tuple(STORIES)
_ANSWER = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}


def _operand_range(digits: int) -> range:
    return range(10 ** (digits - 1) if digits > 1 else 1, 10 ** digits)


def _draw(rng: random.Random, level: str, digits: int) -> tuple[int, int]:
    """Operands (a, b) of one problem of ``level``."""
    ops = _operand_range(digits)
    if level == "mul":
        return rng.randint(2, 12), rng.choice(ops)
    a, b = rng.choice(ops), rng.choice(ops)
    if level == "sub":
        while a == b:  # a strictly positive difference
            b = rng.choice(ops)
        a, b = max(a, b), min(a, b)
    return a, b


def _space(level: str, digits: int) -> int:
    """How many distinct (a, b) a level has."""
    n = len(_operand_range(digits))
    return {"add": n * n, "sub": n * (n - 1) // 2, "mul": 11 * n}[level]


def word_problems(cfg: DataConfig, split: str) -> list[tuple[str, int, int, str]]:
    """(level, a, b, story text) of ``split`` ('train' or 'test'), deterministic in the config."""
    if cfg.arithmetic_operands != 2:
        raise DatasetError(f"data.arithmetic_operands={cfg.arithmetic_operands}: word_arithmetic stories have "
                           f"two numbers (leave it at 2)")
    digits = cfg.arithmetic_digits
    train_size = cfg.arithmetic_train_size if cfg.arithmetic_train_size is not None else 1000  # ours
    # Rejection sampling stays quick while each level uses at most 3/4 of its distinct problems.
    per_level = -(-(cfg.arithmetic_test_size + train_size) // len(LEVELS))
    smallest = min(LEVELS, key=lambda lvl: _space(lvl, digits))
    if per_level > _space(smallest, digits) * 3 // 4:
        raise DatasetError(f"data.arithmetic_test_size + arithmetic_train_size = "
                           f"{cfg.arithmetic_test_size + train_size} needs {per_level} problems per level, more "
                           f"than 3/4 of the {_space(smallest, digits)} distinct {smallest!r} problems with "
                           f"{digits}-digit operands")
    key = f"word_arithmetic:{digits}:{cfg.arithmetic_seed}"
    seen: set[tuple[str, int, int]] = set()

    def draw(rng: random.Random, size: int) -> list[tuple[str, int, int, str]]:
        out = []
        while len(out) < size:
            level = LEVELS[len(out) % len(LEVELS)]  # equal shares, interleaved
            a, b = _draw(rng, level, digits)
            if (level, a, b) in seen:
                continue
            seen.add((level, a, b))
            story = rng.choice(STORIES[level]).format(n=rng.choice(NAMES), t=rng.choice(THINGS),
                                                      c=rng.choice(CONTAINERS), a=a, b=b)
            out.append((level, a, b, story))
        return out

    test = draw(random.Random(key + ":test"), cfg.arithmetic_test_size)
    return test if split == "test" else draw(random.Random(key + ":train"), train_size)


def load_word_arithmetic(cfg: DataConfig) -> list[Record]:
    return [Record(id=f"word_arithmetic/{cfg.split}/{k}/{level}", prompt=story, answer=str(_ANSWER[level](a, b)))
            for k, (level, a, b, story) in enumerate(word_problems(cfg, cfg.split))]


def level_of(record_id: str) -> str:
    """The level ('add', 'sub', 'mul') of a word_arithmetic record id."""
    return record_id.rsplit("/", 1)[1]


# Answer format "none": the story alone, no instruction; the SmolLM2 recipe asks for the number in
# a system message (examples/smollm2/grpo.yaml).
register_dataset("word_arithmetic", DatasetSpec(load_word_arithmetic, {"train": None, "test": None}, "none", "math",
                                               "Graded arithmetic word problems (add / sub / mul) for small "
                                               "pretrained models",
                                               eval_max_new_tokens=64))  # the SmolLM2 recipe's: one sentence
