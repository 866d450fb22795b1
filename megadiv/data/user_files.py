"""A user's own data: a JSON-lines file (``data.name: jsonl``), or anything Hugging Face ``datasets``
reads (``data.name: hf``): a Parquet, JSON/JSONL or CSV file, or a ``save_to_disk`` directory.

Both map fields by name (``data.prompt_field``, ``answer_field``, ``tests_field``, ``id_field``),
and a dotted name reaches into nested fields. A prompt is a string, or a list of chat messages
``[{role, content}, ...]`` that the tokenizer's chat template renders as they are. verl's RL Parquet
files (``prompt`` as messages, the gold answer in ``reward_model.ground_truth``) therefore load as
they are::

    data: {name: hf, path: gsm8k/train.parquet, answer_field: reward_model.ground_truth}

Every problem is one line naming the file, the row (0-based, as the ids) and the field.
"""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Optional

from megadiv.data.config import DataConfig
from megadiv.data.datasets import DatasetError, DatasetSpec, Record, read_jsonl, register_dataset, shadowed_builtins

HF_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
"""File suffix -> the ``datasets`` builder that reads it (a directory is read by load_from_disk)."""


def _jsonl(cfg: DataConfig) -> list[Record]:
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise DatasetError(f"data.path: no such file {path}")
    return records_from_rows(read_jsonl(path), cfg, path)


def _hf(cfg: DataConfig) -> list[Record]:
    path = Path(cfg.path).expanduser()
    return records_from_rows(read_hf(path, cfg.split), cfg, path)


def read_hf(path: Path, split: str) -> list[dict]:
    """The rows of ``path`` as Python dicts (nested structs as dicts, lists as lists), read through
    Hugging Face ``datasets``. ``split`` picks one split of a saved DatasetDict."""
    import datasets

    with _without_progress_bars(datasets):
        return _read_hf(datasets, path, split)


@contextmanager
def _without_progress_bars(datasets):
    """datasets' "Generating train split" bars say nothing for a file read into memory at once, and
    would split a one-line error report; they are back on afterwards if they were on."""
    was_on = not datasets.are_progress_bars_disabled()
    if was_on:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _read_hf(datasets, path: Path, split: str) -> list[dict]:
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise DatasetError(f"data.path: {path} is not a directory written by datasets' save_to_disk "
                               f"({_one_line(e)})") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DatasetError(f"data.split: {path} has no split {split!r}; splits: {sorted(loaded)}")
            loaded = loaded[split]
        return loaded.to_list()
    if not path.is_file():
        raise DatasetError(f"data.path: no such file or directory {path}")
    kind = HF_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DatasetError(f"data.path: {path}: data.name hf reads {', '.join(HF_FORMATS)} files or a save_to_disk "
                           f"directory, not {path.suffix or 'a file without suffix'}")
    # A private cache, dropped after the load: nothing accumulates in ~/.cache, every load reads the
    # file as it is now, and ranks loading at once do not contend for one cache's locks.
    with tempfile.TemporaryDirectory(prefix="megadiv-hf-") as cache:
        try:
            return datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=cache,
                                         keep_in_memory=True).to_list()
        except Exception as e:  # datasets wraps the parser's error (pyarrow, pandas), which names the row
            if path.suffix.lower() == ".jsonl":
                read_jsonl(path)  # a line that is not JSON: this names the file and the line
            raise DatasetError(f"{path}: not a readable {kind} file: {_parser_message(e)}") from None


def records_from_rows(rows: Iterable[dict], cfg: DataConfig, path: Path) -> list[Record]:
    """One Record per row, fields taken by (dotted) name; ids are the row numbers without id_field."""
    records = []
    for n, row in enumerate(rows):
        get = partial(_field, row, f"{path}: row {n}")
        prompt = get(cfg.prompt_field, (str, list), "a string or a list of chat messages")
        messages = _messages(prompt, f"{path}: row {n} field {cfg.prompt_field!r}") if isinstance(prompt, list) else ()
        answer = get(cfg.answer_field, (str, int, float))
        tests = get(cfg.tests_field, (list,))
        if tests is not None and (not tests or not all(isinstance(t, str) and t.strip() for t in tests)):
            # Zero tests would grade every program as correct (or, now, as wrong): a dataset error.
            raise DatasetError(f"{path}: row {n} field {cfg.tests_field!r} must be a non-empty list of "
                               f"test statements, got {tests!r:.200}")
        solution = get(cfg.solution_field, (str,))
        setup = get(cfg.test_setup_field, (str, list), "a string or a list of lines")
        if isinstance(setup, list):
            if not all(isinstance(line, str) for line in setup):
                raise DatasetError(f"{path}: row {n} field {cfg.test_setup_field!r} must be a list of strings, "
                                   f"got {setup!r:.200}")
            setup = "\n".join(setup)
        records.append(Record(id=str(get(cfg.id_field, (str, int)) if cfg.id_field else n),
                              prompt=_last_user_content(messages) if messages else prompt,
                              answer=None if answer is None else str(answer), tests=tuple(tests or ()),
                              test_setup=setup or "", solution=solution,
                              program_names=_program_names(get, cfg, tuple(tests or ()), solution, f"{path}: row {n}"),
                              messages=messages))
    return records


def _program_names(get, cfg: DataConfig, tests: tuple[str, ...], solution: Optional[str], where: str) -> tuple[str, ...]:
    """Builtin names the tests call that are the program's: those the reference solution defines at
    its top level (as the MBPP loaders derive them) and those program_names_field lists."""
    listed = get(cfg.program_names_field, (list,)) or []
    if not all(isinstance(name, str) and name.isidentifier() for name in listed):
        raise DatasetError(f"{where} field {cfg.program_names_field!r} must be a list of names, got {listed!r:.200}")
    derived: tuple[str, ...] = ()
    if tests and solution is not None:
        try:
            derived = shadowed_builtins(tests, solution)
        except SyntaxError as e:
            raise DatasetError(f"{where} field {cfg.solution_field!r} is not a Python program ({e.msg}, "
                               f"line {e.lineno})") from None
    return tuple(sorted(set(listed) | set(derived)))


def _field(row: dict, where: str, key: Optional[str], kinds: tuple[type, ...], expected: str = "") -> Any:
    """The value of field ``key`` of ``row`` (``where``: file and row), one of ``kinds``; None for no key."""
    if key is None:
        return None
    value = field_value(row, key, where)
    if not isinstance(value, kinds):
        got = "null" if value is None else f"{type(value).__name__} {value!r:.80}"
        raise DatasetError(f"{where} field {key!r} is {got}, expected "
                           + (expected or " or ".join(k.__name__ for k in kinds)))
    return value


def field_value(row: dict, key: str, where: str) -> Any:
    """``row[key]``; a dotted key (``reward_model.ground_truth``) walks nested fields, unless the row
    has a field of that very name."""
    if key in row:
        return row[key]
    node, walked = row, []
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            holds = sorted(node) if isinstance(node, dict) else f"a {type(node).__name__}, not fields"
            inside = f"'{'.'.join(walked)}' holds" if walked else "fields:"
            raise DatasetError(f"{where} has no field {key!r} ({inside} {holds})")
        node = node[part]
        walked.append(part)
    return node


def _messages(value: list, where: str) -> tuple[tuple[str, str], ...]:
    """A prompt given as chat messages: a non-empty list of {role, content} with string values."""
    if not value:
        raise DatasetError(f"{where} is an empty list of chat messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DatasetError(f"{where} message {i} is {m!r:.120}, expected {{'role': str, 'content': str}}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "null" if m.get(key) is None else f"{type(m[key]).__name__} {m[key]!r:.80}"
                raise DatasetError(f"{where} message {i} has {key} {got}, expected a string")
    return tuple((m["role"], m["content"]) for m in value)


def _last_user_content(messages: tuple[tuple[str, str], ...]) -> str:
    users = [content for role, content in messages if role == "user"]
    return users[-1] if users else messages[-1][1]


def _parser_message(error: BaseException) -> str:
    """The parser's message (pyarrow's names the row, pandas' the line) from under the
    DatasetGenerationError that ``datasets`` wraps it in."""
    from datasets.exceptions import DatasetGenerationError

    while isinstance(error, DatasetGenerationError) and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return _one_line(error)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


register_dataset("jsonl", DatasetSpec(_jsonl, {}, "boxed", "math", "A user's JSON-lines file", any_split=True))
register_dataset("hf", DatasetSpec(_hf, {}, "boxed", "math", "A user's Parquet, JSON/JSONL or CSV file, or a "
                                                            "datasets save_to_disk directory", any_split=True))
