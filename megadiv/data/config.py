"""DataConfig: which dataset and split, how prompts are rendered, and how they are shuffled."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

TemplateName = Literal["auto", "chat", "plain", "raw"]
AnswerFormat = Literal["default", "boxed", "hash", "code", "none"]
PromptStyle = Literal["default", "gbmpo_eval", "gbmpo_train"]
USER_FILE_DATASETS = ("jsonl", "hf")


@dataclass(frozen=True)
class DataConfig:
    """One dataset split as the trainer consumes it. A run usually holds two: training and held-out."""

    name: str = "gsm8k"
    """Registry name: gsm8k, math500, aime24, aime25, mbpp, mbpp_sanitized, arithmetic,
    word_arithmetic, jsonl and hf (a user's file), or one added with ``megadiv.data.register_dataset``."""
    split: str = "train"
    """Split of that dataset (gsm8k: train/test; mbpp: prompt/test/validation/train/all, and the GBMPO
    authors' gbmpo_train (299) / gbmpo_validation (75) of train; ...)."""
    seed: int = 1234
    """Seed of the epoch shuffles (``PromptSampler``)."""
    shuffle: bool = True
    """Shuffle every epoch; False keeps file order (evaluation)."""
    template: TemplateName = "auto"
    """auto: the tokenizer's chat template when it has one, else plain; chat: require one;
    plain: 'Question: ...\\nAnswer:'; raw: the problem text alone (the synthetic task)."""
    answer_format: AnswerFormat = "default"
    """Answer format the prompt asks for: boxed (\\boxed{...}), hash (#### ...), code (a ```python
    block), none; default takes the dataset's own."""
    system_prompt: Optional[str] = None
    """System message for chat templates (None: no system message)."""
    prompt_style: PromptStyle = "default"
    """default: the problem, the tests (code) and the answer-format instruction (templates.py);
    gbmpo_eval / gbmpo_train: the GBMPO authors' prompts (Lexsi-Labs/aligntune, meta_es), which
    carry their own system message. GSM8K (any non-code format): system 'You are a careful math
    tutor...', user 'Problem:\\n<question>', both styles. MBPP (answer_format code): gbmpo_eval is
    their validation/test prompt (a system message asking for one ```python block, then the task and
    its tests); gbmpo_train their training prompt (the task, the exact signature to implement, and
    rules; no system message)."""
    enable_thinking: Optional[bool] = None
    """Passed to the chat template as ``enable_thinking`` (Qwen3: False turns the <think> block off).
    None: the template's default. True needs a template that takes it; False on a template without
    a thinking mode is accepted (there is nothing to turn off)."""
    max_items: Optional[int] = None
    """Keep only the first N records of the split (after loading, before shuffling)."""

    # jsonl, hf: a user's own file (megadiv/data/user_files.py). A field name may be dotted to reach
    # into nested fields (verl's reward_model.ground_truth).
    path: Optional[str] = None
    """jsonl: the JSON-lines file; hf: a Parquet, JSON/JSONL or CSV file, or a directory written by
    datasets' save_to_disk (a saved DatasetDict: ``split`` picks the split)."""
    prompt_field: str = "prompt"
    """jsonl, hf: field holding the problem text, or a list of chat messages [{role, content}, ...]
    that the tokenizer's chat template renders as they are (as verl's prompt column)."""
    answer_field: Optional[str] = "answer"
    """jsonl, hf: field holding the gold answer (math / exact match), or None; verl's files:
    reward_model.ground_truth."""
    tests_field: Optional[str] = None
    """jsonl, hf: field holding a list of assert statements (code), or None."""
    id_field: Optional[str] = None
    """jsonl, hf: field holding a record id; None numbers the rows from 0."""
    solution_field: Optional[str] = None
    """jsonl, hf: field holding the reference solution (a program for code tasks: a builtin name its
    top-level definitions take over, MBPP 126's ``sum``, is the program's in the tests), or None."""
    test_setup_field: Optional[str] = None
    """jsonl, hf: field holding code run between the program and its tests (a string or a list of
    lines: MBPP's test_setup_code, sanitized MBPP's test_imports), or None. Needs tests_field."""
    program_names_field: Optional[str] = None
    """jsonl, hf: field holding a list of the builtin names the tests call that the program defines
    (added to those solution_field gives), or None. Needs tests_field."""
    expected_rows: Optional[int] = None
    """jsonl, hf: row count the file must have (checked on load); None skips the check."""

    # arithmetic: the synthetic task 'a+b=' for small demos; word_arithmetic: graded word problems.
    arithmetic_digits: int = 2
    """Digits per operand: operands are drawn from [0, 10**digits) (word_arithmetic: operands of
    exactly this many digits, the multiplier of its 'mul' level 2..12)."""
    arithmetic_operands: int = 2
    """Operands per problem (2 gives 'a+b='; word_arithmetic accepts only 2)."""
    arithmetic_test_size: int = 500
    """Held-out problems; fixed by arithmetic_seed, independent of the sizes of the train split."""
    arithmetic_train_size: Optional[int] = None
    """Training problems, disjoint from the held-out ones; None: every remaining problem
    (word_arithmetic: 1000)."""
    arithmetic_seed: int = 0
    """Seed that fixes the problem sets (the shuffle seed is ``seed``)."""

    def __post_init__(self):
        _check(bool(self.name), "name", "must be non-empty")
        _check(bool(self.split), "split", "must be non-empty")
        _check(self.max_items is None or self.max_items >= 1, "max_items", f"must be >= 1, got {self.max_items}")
        _check(self.expected_rows is None or self.expected_rows >= 0, "expected_rows",
               f"must be >= 0, got {self.expected_rows}")
        _check(not self.user_file or bool(self.path), "path", f"is required when name is {self.name!r}")
        _check(not self.user_file or self.answer_field is not None or self.tests_field is not None,
               "answer_field", f"{self.name} needs answer_field or tests_field")
        for key in ("solution_field", "test_setup_field", "program_names_field"):
            _check(getattr(self, key) is None or self.user_file, key,
                   f"is read from a user's file only (name jsonl or hf), not {self.name!r}")
        for key in ("test_setup_field", "program_names_field"):
            _check(getattr(self, key) is None or self.tests_field is not None, key, "needs tests_field (code tasks)")
        _check(self.prompt_style == "default" or self.system_prompt is None, "system_prompt",
               f"must be unset with prompt_style={self.prompt_style!r} (that prompt has its own system message)")
        _check(self.prompt_style == "default" or self.template != "raw", "prompt_style",
               "needs a chat or plain template, not 'raw'")
        _check(1 <= self.arithmetic_digits <= 9, "arithmetic_digits", f"must lie in [1, 9], got {self.arithmetic_digits}")
        _check(2 <= self.arithmetic_operands <= 8, "arithmetic_operands",
               f"must lie in [2, 8], got {self.arithmetic_operands}")
        _check(self.arithmetic_test_size >= 1, "arithmetic_test_size", f"must be >= 1, got {self.arithmetic_test_size}")
        _check(self.arithmetic_train_size is None or self.arithmetic_train_size >= 1, "arithmetic_train_size",
               f"must be >= 1, got {self.arithmetic_train_size}")

    @property
    def user_file(self) -> bool:
        """A user's file (jsonl, hf), read through the field keys."""
        return self.name in USER_FILE_DATASETS


def _check(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise ValueError(f"data.{key} {reason}")
