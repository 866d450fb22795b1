"""Datasets: one record type, a registry of loaders, row counts checked on every load.

A loader turns a :class:`DataConfig` into records; :func:`load_dataset` looks the name up, checks
the split and the number of rows against what the registry entry expects, and trims to
``max_items``. The shipped files live in ``files/<dataset>/`` with their licenses (SOURCES.md)::

    ds = load_dataset(DataConfig(name="gsm8k", split="test"))   # 1,319 records, or DatasetError

A user's own data is a file plus a config entry (``name: jsonl`` or ``hf``, ``path``, field names;
megadiv/data/user_files.py), or a Python loader added with :func:`register_dataset`.
"""
from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from megadiv.data.code_tests import BUILTIN_NAMES, JUDGE_MODULES, UnsplittableTest, plan_test
from megadiv.data.config import DataConfig

FILES = Path(__file__).resolve().parent / "files"


class DatasetError(ValueError):
    """A dataset that cannot be used as configured: unknown name or split, wrong row count, bad field."""


@dataclass(frozen=True)
class Record:
    """One problem. Math and exact-match tasks carry ``answer``; code tasks carry ``tests``."""

    id: str
    prompt: str
    """The problem statement, before any template."""
    answer: Optional[str] = None
    """Gold final answer (a number or a LaTeX expression, without \\boxed)."""
    tests: tuple[str, ...] = ()
    """Assert statements a program must pass (code tasks)."""
    test_setup: str = ""
    """Code run after the program and before the tests (MBPP test_setup_code, test imports)."""
    solution: Optional[str] = None
    """Reference solution: worked text (GSM8K, MATH) or a program (MBPP)."""
    program_names: tuple[str, ...] = ()
    """Functions of the program the tests call although Python has a builtin of that name (MBPP
    126 defines ``sum``); every other builtin name in a test is Python's (code_tests.plan_test)."""
    messages: tuple[tuple[str, str], ...] = ()
    """(role, content) chat messages given by the data file itself (verl's ``prompt`` column): the
    chat template renders them as they are, and ``prompt`` holds the last user message's content."""


@dataclass(frozen=True)
class Dataset:
    """The records of one split, in file order, and the answer format its prompts ask for."""

    name: str
    split: str
    records: tuple[Record, ...]
    answer_format: str
    """boxed, hash, code or none: the answer format this dataset's prompts ask for by default
    (``DataConfig.answer_format`` overrides it in the template)."""
    reward: str
    """Name of the reward this dataset is meant for (``megadiv.rewards.build_reward``)."""

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Record:
        return self.records[i]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)


Loader = Callable[[DataConfig], list[Record]]


@dataclass(frozen=True)
class DatasetSpec:
    """A registry entry: how to load a split, how many rows each split must have, its defaults."""

    loader: Loader
    splits: dict[str, Optional[int]]
    """Split name -> expected row count (None: not fixed, e.g. depends on the config)."""
    answer_format: str
    reward: str
    description: str = ""
    any_split: bool = False
    """Accept any split name (user files, whose only split is the file itself)."""
    eval_max_new_tokens: int = 1024
    """``megadiv eval``'s default response length for this set: room for the answers its prompts ask for
    (docs/data_and_rewards.md gives each set's reason); a thinking model needs more (--max-new-tokens)."""


DATASETS: dict[str, DatasetSpec] = {}


def register_dataset(name: str, spec: DatasetSpec, *, overwrite: bool = False) -> None:
    """Add a dataset under ``name`` (a ``DataConfig.name``)."""
    if name in DATASETS and not overwrite:
        raise DatasetError(f"dataset {name!r} is already registered (pass overwrite=True to replace it)")
    DATASETS[name] = spec


def load_dataset(cfg: DataConfig) -> Dataset:
    """Load ``cfg.split`` of ``cfg.name`` and check its row count; raises DatasetError with the reason."""
    spec = DATASETS.get(cfg.name)
    if spec is None:
        raise DatasetError(f"data.name: unknown dataset {cfg.name!r}; registered: {sorted(DATASETS)}")
    if cfg.split not in spec.splits and not spec.any_split:
        raise DatasetError(f"data.split: {cfg.name} has no split {cfg.split!r}; splits: {sorted(spec.splits)}")
    records = spec.loader(cfg)
    expected = cfg.expected_rows if spec.any_split else spec.splits[cfg.split]
    _check_rows(f"{cfg.name}/{cfg.split}", len(records), expected)
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        raise DatasetError(f"{cfg.name}/{cfg.split}: record ids are not unique")
    if cfg.max_items is not None:
        records = records[: cfg.max_items]
    for record in records:
        _check_tests(record)
    return Dataset(cfg.name, cfg.split, tuple(records), spec.answer_format, spec.reward)


def _check_rows(what: str, found: int, expected: Optional[int]) -> None:
    if expected is not None and found != expected:
        raise DatasetError(f"{what}: expected {expected} rows, found {found}; the data file is incomplete "
                           f"or not the one documented in megadiv/data/files/SOURCES.md")


def _check_tests(record: Record) -> None:
    """Every test of a code record can be graded outside the program (code_tests.plan_test)."""
    for k, test in enumerate(record.tests):
        try:
            plan_test(test, record.test_setup, record.program_names)
        except UnsplittableTest as e:
            raise DatasetError(f"{record.id}: test {k} cannot be graded: {e}") from None


def shadowed_builtins(tests: tuple[str, ...], program: str) -> tuple[str, ...]:
    """Names the tests call that are Python builtins and that ``program`` (a reference solution)
    defines at its top level: those calls are the program's (MBPP 126's ``sum(10, 15)``). Only a
    name every test calls on constants alone: a reference's helper named ``abs`` must not turn the
    grader's ``abs(area(2) - 12.56)`` into a call into the program (which then answers anything)."""
    calls = [node for tree in map(_parsed_or_none, tests) if tree is not None for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    on_values = {call.func.id for call in calls if not all(map(_constant, [*call.args, *call.keywords]))}
    called = {call.func.id for call in calls} - on_values
    defined = {node.name for node in ast.parse(program).body
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return tuple(sorted(called & defined & (BUILTIN_NAMES | set(JUDGE_MODULES))))


_CONSTANT_NODES = (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp, ast.keyword,
                   ast.Starred, ast.operator, ast.unaryop, ast.expr_context)


def _constant(node: ast.AST) -> bool:
    """Literals, containers and arithmetic of them: no name, no call."""
    return all(isinstance(n, _CONSTANT_NODES) for n in ast.walk(node))


def _parsed_or_none(test: str) -> Optional[ast.Module]:
    """A test's syntax tree; None for one that is not Python (plan_test refuses it, naming the record)."""
    try:
        return ast.parse(test)
    except SyntaxError:
        return None


def read_jsonl(path: Path) -> list[dict]:
    """Parse a JSON-lines file (blank lines skipped); errors name the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{n}: not valid JSON ({e})") from e
    return rows


# --------------------------------------------------------------------------- shipped datasets


def _gsm8k(cfg: DataConfig) -> list[Record]:
    # Each answer is worked text ending in "#### <number>"; the number may carry thousands commas.
    # gbmpo_train / gbmpo_validation: the authors' 80/20 ES split of train (gbmpo_es_rows); ids keep
    # the train row, so the two are visibly disjoint.
    file = "train" if cfg.split.startswith("gbmpo_") else cfg.split
    rows = read_jsonl(FILES / "gsm8k" / f"{file}.jsonl")
    if file != cfg.split:
        _check_rows("gsm8k train file", len(rows), 7473)
        picked = gbmpo_es_rows(len(rows), cfg.split)
    else:
        picked = range(len(rows))
    return [Record(id=f"gsm8k/{file}/{i}", prompt=rows[i]["question"],
                   answer=rows[i]["answer"].rsplit("####", 1)[1].strip().replace(",", ""), solution=rows[i]["answer"])
            for i in picked]


def _math500(cfg: DataConfig) -> list[Record]:
    return [Record(id=f"math500/{r['unique_id']}", prompt=r["problem"], answer=r["answer"], solution=r["solution"])
            for r in read_jsonl(FILES / "math500" / "test.jsonl")]


def _aime(year: str) -> Loader:
    def load(cfg: DataConfig) -> list[Record]:
        # AIME 2024 rows carry an id and a solution; the 2025 file has only problem and answer.
        rows = read_jsonl(FILES / f"aime{year}" / "test.jsonl")
        return [Record(id=f"aime{year}/{r.get('id', i)}", prompt=r["problem"], answer=str(r["answer"]),
                       solution=r.get("solution")) for i, r in enumerate(rows)]
    return load


# Standard MBPP split by task id (Austin et al. 2021): inclusive ranges.
MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974),
               "all": (1, 974)}


def gbmpo_es_rows(n: int, split: str) -> list[int]:
    """The GBMPO authors' ES split of a training set of n rows (Lexsi-Labs/aligntune, meta_es:
    es_utils.py get_mbpp_splits, vllm_evaluator_math.py get_gsm8k_splits): scikit-learn's
    ``train_test_split(range(n), test_size=0.2, random_state=42)``, i.e. the permutation of numpy's
    ``RandomState(42)``, whose first ceil(0.2 n) entries are the validation rows and the rest the
    inner training rows. Row indices in the authors' order; the two splits are disjoint."""
    import numpy as np

    order = np.random.RandomState(42).permutation(n)
    n_val = math.ceil(0.2 * n)
    return [int(i) for i in {"gbmpo_validation": order[:n_val], "gbmpo_train": order[n_val:]}[split]]


def gbmpo_mbpp_task_ids(split: str) -> list[int]:
    """MBPP's 374 training tasks (ids 601-974; row i is task 601 + i) split as the authors split
    them: gbmpo_train 299 tasks, gbmpo_validation 75 (``gbmpo_es_rows``)."""
    first, last = MBPP_SPLITS["train"]
    return [first + i for i in gbmpo_es_rows(last - first + 1, split)]


def _mbpp_split(rows: list[dict], split: str, total: int, what: str) -> list[dict]:
    _check_rows(what, len(rows), total)  # the whole file first: a truncated file must not pass as a split
    if split.startswith("gbmpo_"):
        by_id = {r["task_id"]: r for r in rows}
        return [by_id[i] for i in gbmpo_mbpp_task_ids(split)]
    lo, hi = MBPP_SPLITS[split]
    return [r for r in rows if lo <= r["task_id"] <= hi]


def _mbpp(cfg: DataConfig) -> list[Record]:
    rows = _mbpp_split(read_jsonl(FILES / "mbpp" / "mbpp.jsonl"), cfg.split, 974, "mbpp file")
    return [Record(id=f"mbpp/{r['task_id']}", prompt=r["text"], tests=tuple(r["test_list"]),
                   test_setup=r["test_setup_code"], solution=r["code"],
                   program_names=shadowed_builtins(tuple(r["test_list"]), r["code"])) for r in rows]


def _mbpp_sanitized(cfg: DataConfig) -> list[Record]:
    with open(FILES / "mbpp" / "sanitized-mbpp.json", encoding="utf-8") as f:
        rows = _mbpp_split(json.load(f), cfg.split, 427, "mbpp_sanitized file")
    return [Record(id=f"mbpp_sanitized/{r['task_id']}", prompt=r["prompt"], tests=tuple(r["test_list"]),
                   test_setup="\n".join(r["test_imports"]), solution=r["code"],
                   program_names=shadowed_builtins(tuple(r["test_list"]), r["code"])) for r in rows]


def _register_builtins() -> None:
    # eval_max_new_tokens: the power of two that holds (nearly) every reference solution of the set, in
    # SmolLM2's 49k BPE tokens (docs/data_and_rewards.md, "Evaluation lengths", has the measurements)
    builtins = {
        "gsm8k": DatasetSpec(_gsm8k, {"train": 7473, "test": 1319, "gbmpo_train": 5978, "gbmpo_validation": 1495},
                             "hash", "math", "Grade-school maths word problems (Cobbe et al. 2021); gbmpo_train / "
                                             "gbmpo_validation: the GBMPO authors' 5,978 / 1,495 ES split of train",
                             eval_max_new_tokens=512),
        "math500": DatasetSpec(_math500, {"test": 500}, "boxed", "math",
                               "PRM800K's 500-problem test subset of MATH (Hendrycks et al. 2021)",
                               eval_max_new_tokens=2048),
        "aime24": DatasetSpec(_aime("24"), {"test": 30}, "boxed", "math", "AIME 2024 I and II",
                              eval_max_new_tokens=4096),
        "aime25": DatasetSpec(_aime("25"), {"test": 30}, "boxed", "math", "AIME 2025 I and II",
                              eval_max_new_tokens=4096),
        "mbpp": DatasetSpec(_mbpp, {"prompt": 10, "test": 500, "validation": 90, "train": 374, "all": 974,
                                    "gbmpo_train": 299, "gbmpo_validation": 75},
                            "code", "code", "Mostly Basic Python Problems (Austin et al. 2021); gbmpo_train / "
                                            "gbmpo_validation: the GBMPO authors' 299 / 75 split of train",
                            eval_max_new_tokens=512),
        "mbpp_sanitized": DatasetSpec(_mbpp_sanitized,
                                      {"prompt": 7, "test": 257, "validation": 43, "train": 120, "all": 427},
                                      "code", "code", "Hand-verified MBPP subset", eval_max_new_tokens=512),
    }
    for name, spec in builtins.items():
        register_dataset(name, spec)


_register_builtins()

