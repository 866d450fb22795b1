"""Prompt templates: the tokenizer's chat template when it has one, a plain template otherwise.

Every non-raw prompt states the answer format its reward parses, so a policy can learn it::

    tpl = PromptTemplate.resolve(data_cfg, dataset, tokenizer)
    ids = tpl.token_ids(record, tokenizer)          # what the rollout engine receives

Formats: ``boxed`` (the math reward reads the last ``\\boxed{...}``), ``hash`` (the text after the
last ``####``), ``code`` (the code reward runs the last ```python block against the tests, which
the prompt lists), ``none`` (no instruction: the synthetic task's ``17+25=``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megadiv.data.config import DataConfig
from megadiv.data.datasets import Dataset, Record

INSTRUCTIONS = {
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "hash": "Please reason step by step, and write the final answer alone on the last line after "
            "'#### ' (for example: #### 42).",
    "code": "Write a Python program that solves the task. Put the complete program in a single "
            "```python code block.",
    "none": "",
}


def problem_text(record: Record, answer_format: str) -> str:
    """The problem, the tests a program must pass (code), and the answer-format instruction."""
    if answer_format not in INSTRUCTIONS:
        raise ValueError(f"answer_format must be one of {sorted(INSTRUCTIONS)}, got {answer_format!r}")
    parts = [record.prompt.strip()]
    if answer_format == "code" and record.tests:
        parts.append("Your code should pass these tests:\n" + "\n".join(record.tests))
    if INSTRUCTIONS[answer_format]:
        parts.append(INSTRUCTIONS[answer_format])
    return "\n\n".join(parts)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class PromptTemplate:
    """A resolved template: ``kind`` is chat, plain or raw (never auto)."""

    kind: Literal["chat", "plain", "raw"]
    answer_format: str
    system_prompt: Optional[str] = None

    @classmethod
    def resolve(cls, cfg: DataConfig, dataset: Dataset, tokenizer=None) -> "PromptTemplate":
        """Pick the template ``cfg.template`` asks for; ``auto`` picks chat iff the tokenizer has one."""
        kind = cfg.template
        if kind == "auto":
            kind = "chat" if has_chat_template(tokenizer) else "plain"
        if kind == "chat" and not has_chat_template(tokenizer):
            raise ValueError("data.template='chat' but the tokenizer has no chat_template")
        answer_format = dataset.answer_format if cfg.answer_format == "default" else cfg.answer_format
        return cls(kind, answer_format, cfg.system_prompt)

    def text(self, record: Record, tokenizer=None) -> str:
        """The prompt as text (for a chat template, rendered up to the assistant's turn)."""
        if self.kind == "raw":
            return record.prompt
        body = problem_text(record, self.answer_format)
        if self.kind == "plain":
            system = f"{self.system_prompt}\n\n" if self.system_prompt else ""
            return f"{system}Question: {body}\nAnswer:"
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        messages.append({"role": "user", "content": body})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def token_ids(self, record: Record, tokenizer) -> list[int]:
        """Prompt token ids. A rendered chat template already holds its special tokens; plain and raw
        prompts get the tokenizer's usual ones (e.g. a BOS)."""
        return list(tokenizer(self.text(record, tokenizer), add_special_tokens=self.kind != "chat")["input_ids"])
