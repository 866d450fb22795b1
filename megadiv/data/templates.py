"""Prompt templates: the tokenizer's chat template when it has one, a plain template otherwise.

Every non-raw prompt states the answer format its reward parses, so a policy can learn it::

    tpl = PromptTemplate.resolve(data_cfg, dataset, tokenizer)
    ids = tpl.token_ids(record, tokenizer)          # what the rollout engine receives

``data.prompt_style`` gbmpo_eval / gbmpo_train render the GBMPO authors' prompts instead
(:func:`gbmpo_messages`); ``data.enable_thinking`` goes to chat templates that take it (Qwen3).
Records that carry their own chat messages (a verl Parquet file's prompts) are rendered by the chat
template as they are, with nothing added.

Formats: ``boxed`` (the math reward reads the last ``\\boxed{...}``), ``hash`` (the text after the
last ``####``), ``code`` (the code reward runs the last ```python block against the tests, which
the prompt lists), ``none`` (no instruction: the synthetic task's ``17+25=``).
"""
from __future__ import annotations

import re
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


# The GBMPO authors' prompts (Lexsi-Labs/aligntune, src/aligntune/backends/trl/rl/meta_es):
# GSM8K (train_nmdrgrpo_es_math.py to_prompt; the evaluator's build_gsm8k_prompt is the same).
GBMPO_MATH_SYSTEM = "You are a careful math tutor. Solve step by step and provide the final numeric answer."
# MBPP validation / test (vllm_evaluator.py: DEFAULT_SYSTEM_NO_REASONING and build_mbpp_prompt).
GBMPO_CODE_SYSTEM = ("You are a helpful Python coding assistant. Output ONLY the final code solution.\n"
                     "Rules:\n"
                     "1) Do NOT include explanations or thinking steps.\n"
                     "2) Return Python code in a single fenced block like:\n"
                     "```python\n<code here>\n```\n"
                     "3) If tests or function signature are given, satisfy them exactly.\n")
# MBPP training (train_nmdrgrpo_code.py): one user message, no system message. The authors prefix
# it with a bookkeeping marker "__SAMPLE_ID:<row>__ " that their reward uses to find the tests; we
# leave it out (our records carry their tests), the one difference from their text.
GBMPO_CODE_TRAIN = """{task}

IMPLEMENT EXACTLY THIS FUNCTION:

{signature}
    # Your implementation here

REQUIREMENTS:
- Use ONLY this function name: {name}
- Accept exactly these parameters: {params}
- Return a value, do not print
- Use only ASCII characters
- Output ONLY Python code
- No markdown, no explanations, no examples"""


def tested_function(test: str) -> tuple[Optional[str], int]:
    """(name, arity) of the first call in an assert, as the authors read it: the first
    ``name(...)``, its arguments counted by top-level commas up to the first ')'."""
    call = re.search(r"(\w+)\s*\(([^)]*)\)", test)
    if call is None:
        return None, 0
    args, depth, commas = call.group(2).strip(), 0, 0
    for ch in args:
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        commas += ch == "," and depth == 0
    return call.group(1), (commas + 1 if args else 0)


def _gbmpo_signature(record: Record) -> tuple[str, list[str]]:
    """Function name from the first test; parameter names from the reference solution's def, else
    arg1..argN (the authors' rule)."""
    name, arity = tested_function(record.tests[0]) if record.tests else (None, 0)
    if name is None:
        return "your_function", []
    ref = re.search(rf"def\s+{re.escape(name)}\s*\(([^)]*)\)", record.solution or "")
    if ref:
        return name, [p.strip().split("=")[0].strip() for p in ref.group(1).split(",") if p.strip()]
    return name, [f"arg{j + 1}" for j in range(arity)]


def gbmpo_messages(record: Record, answer_format: str, style: str) -> list[dict]:
    """Chat messages of the GBMPO authors' prompt for ``record`` (see DataConfig.prompt_style)."""
    if answer_format != "code":
        return [{"role": "system", "content": GBMPO_MATH_SYSTEM},
                {"role": "user", "content": f"Problem:\n{record.prompt}"}]
    if style == "gbmpo_eval":
        tests = "".join(f"{t}\n" for t in record.tests)
        body = f"{record.prompt}\n\nYour code should pass these tests:\n{tests}".strip()
        return [{"role": "system", "content": GBMPO_CODE_SYSTEM}, {"role": "user", "content": body}]
    name, params = _gbmpo_signature(record)
    body = GBMPO_CODE_TRAIN.format(task=record.prompt, signature=f"def {name}({', '.join(params)}):", name=name,
                                   params=", ".join(params) if params else "none")
    return [{"role": "user", "content": body}]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def takes_enable_thinking(tokenizer) -> bool:
    """The chat template reads ``enable_thinking`` (Qwen3's does; most others ignore it)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(template.values())
    return "enable_thinking" in template


def check_message_prompts(cfg: DataConfig) -> None:
    """Prompts given as chat messages are the whole prompt: only a chat template renders them, and
    no data key adds to them (checked by check-config too, before any tokenizer is loaded)."""
    source = cfg.path or f"{cfg.name}/{cfg.split}"
    if cfg.template not in ("auto", "chat"):
        raise ValueError(f"data.template={cfg.template!r} cannot render the chat-message prompts of {source}; "
                         f"use auto or chat")
    for key, default in (("system_prompt", None), ("prompt_style", "default"), ("answer_format", "default")):
        if getattr(cfg, key) != default:
            raise ValueError(f"data.{key} does not apply to the chat-message prompts of {source}: they are "
                             f"rendered as the file gives them (put a system message or instruction in the file)")


@dataclass(frozen=True)
class PromptTemplate:
    """A resolved template: ``kind`` is chat, plain or raw (never auto)."""

    kind: Literal["chat", "plain", "raw"]
    answer_format: str
    system_prompt: Optional[str] = None
    style: str = "default"
    """DataConfig.prompt_style."""
    enable_thinking: Optional[bool] = None
    """Passed to the chat template when not None (only when the template takes it)."""

    @classmethod
    def resolve(cls, cfg: DataConfig, dataset: Dataset, tokenizer=None) -> "PromptTemplate":
        """Pick the template ``cfg.template`` asks for; ``auto`` picks chat iff the tokenizer has one."""
        kind = cfg.template
        if kind == "auto":
            kind = "chat" if has_chat_template(tokenizer) else "plain"
        if any(r.messages for r in dataset):
            check_message_prompts(cfg)
            if not has_chat_template(tokenizer):
                raise ValueError(f"data.prompt_field {cfg.prompt_field!r} of {cfg.path or cfg.name} holds chat "
                                 f"messages, which the tokenizer's chat template renders, and this tokenizer has "
                                 f"none (use a model whose tokenizer has a chat_template, or store the prompts as text)")
        if kind == "chat" and not has_chat_template(tokenizer):
            raise ValueError("data.template='chat' but the tokenizer has no chat_template")
        if cfg.enable_thinking and not (kind == "chat" and takes_enable_thinking(tokenizer)):
            raise ValueError("data.enable_thinking=true but the prompt template has no thinking mode "
                             "(a chat template that reads enable_thinking, e.g. Qwen3's)")
        answer_format = dataset.answer_format if cfg.answer_format == "default" else cfg.answer_format
        thinking = cfg.enable_thinking if kind == "chat" and takes_enable_thinking(tokenizer) else None
        return cls(kind, answer_format, cfg.system_prompt, cfg.prompt_style, thinking)

    def text(self, record: Record, tokenizer=None) -> str:
        """The prompt as text (for a chat template, rendered up to the assistant's turn)."""
        if self.kind == "raw":
            return record.prompt
        if record.messages:  # the file's own chat (resolve made sure the template is a chat template)
            messages = [{"role": role, "content": content} for role, content in record.messages]
        elif self.style == "default":
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            messages.append({"role": "user", "content": problem_text(record, self.answer_format)})
        else:
            messages = gbmpo_messages(record, self.answer_format, self.style)
        if self.kind == "plain":  # the gbmpo styles as the authors' own fallback: system, body, "Answer:"
            *system, user = messages
            head = f"{system[0]['content']}\n\n" if system else ""
            return (f"{head}Question: {user['content']}\nAnswer:" if self.style == "default"
                    else f"{head}{user['content']}\n\nAnswer:")
        thinking = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **thinking)

    def token_ids(self, record: Record, tokenizer) -> list[int]:
        """Prompt token ids. A rendered chat template already holds its special tokens; plain and raw
        prompts get the tokenizer's usual ones (e.g. a BOS)."""
        return list(tokenizer(self.text(record, tokenizer), add_special_tokens=self.kind != "chat")["input_ids"])
