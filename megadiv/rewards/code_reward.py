"""The code reward (MBPP-style): extract the program from a response, run its tests in the sandbox."""
from __future__ import annotations

import ast
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from megadiv.rewards.base import RewardResult
from megadiv.rewards.sandbox import SandboxError, SandboxLimits, SandboxResult, run_sandboxed

log = logging.getLogger(__name__)

_TAG = re.compile(r"[ \t]*([\w+-]*)")  # a fence's language tag: the word after ``` on its line
_PYTHON_TAGS = ("python", "python3", "py")


def fenced_blocks(text: str) -> tuple[list[tuple[str, str]], Optional[tuple[str, str]]]:
    """The ``` blocks of ``text`` as (the rest of the fence's line, code), in order, and the block
    left open at the end (or None). A linear scan (str.find): a response is untrusted text, and a
    lazy regex between fences backtracks quadratically on an open fence followed by whitespace."""
    blocks, pos = [], 0
    while True:
        start = text.find("```", pos)
        newline = text.find("\n", start + 3) if start >= 0 else -1
        if newline < 0:  # no more fences, or one whose line never ends: no block
            return blocks, None
        info = text[start + 3:newline]
        end = text.find("```", newline + 1)
        if end < 0:
            return blocks, (info, text[newline + 1:])
        blocks.append((info, text[newline + 1:end]))
        pos = end + 3


def is_python(source: str) -> bool:
    """Whether ``source`` parses. Deeply nested text (a few thousand unary operators, a long operator
    or attribute chain: what a degenerate policy emits) makes the parser raise RecursionError or
    MemoryError rather than SyntaxError; either means "not a program", never an error of the reward."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def extract_program(response: str) -> Optional[str]:
    """The program in a response, or None.

    Preference: the last ```python block; else the last untagged ``` block; else, when the response
    was cut inside an open ```python block, the text after it; else the whole response if it is
    valid Python.
    """
    blocks, open_block = fenced_blocks(response)
    for tags in (_PYTHON_TAGS, ("",)):
        chosen = [code for info, code in blocks if _TAG.match(info).group(1).lower() in tags]
        if chosen:
            return chosen[-1] if chosen[-1].strip() else None
    if open_block is not None:  # cut inside a block: only one whose fence line is just a python tag
        info, code = open_block
        return code if info.strip(" \t") in (*_PYTHON_TAGS, "") and code.strip() else None
    return response if response.strip() and is_python(response) else None


def code_score(result: SandboxResult, partial_credit: bool) -> tuple[float, str]:
    """(score, reason): 1 when every assert passed; with partial credit a failed run earns
    passed/total; a timeout, crash (forged results included) or limit earns 0, and so do zero tests."""
    if result.status == "passed":
        return 1.0, "correct"
    if result.status == "failed":
        return (result.passed / result.total if partial_credit and result.total else 0.0), "wrong"
    return 0.0, "timeout" if result.status == "timeout" else "crashed"


class CodeReward:
    """Scores responses against ``record.tests``; ``workers`` sandboxes run at once.

    Checks at construction that the sandbox can run (a trivial program): without real isolation
    (and no explicit ``unsafe`` opt-in) the SandboxError comes before training starts."""

    def __init__(self, workers: int, timeout_s: float, partial_credit: bool, limits: SandboxLimits):
        self.timeout_s, self.partial_credit, self.limits = timeout_s, partial_credit, limits
        probe = run_sandboxed("def ok():\n    return True", ["assert ok()"], max(timeout_s, 30.0), limits=limits)
        if probe.status != "passed":
            raise SandboxError(f"the sandbox cannot run a trivial program: {probe.status} ({probe.detail})")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megadiv-sandbox")

    def score(self, response: str, record) -> tuple[float, str]:
        program = extract_program(response)
        if program is None:
            return 0.0, "unparsable"
        result = run_sandboxed(program, record.tests, self.timeout_s, setup=record.test_setup,
                               program_names=record.program_names, limits=self.limits)
        return code_score(result, self.partial_credit)

    def __call__(self, responses: Sequence[str], records: Sequence) -> RewardResult:
        if self.limits.isolation == "unsafe":
            log.warning("code reward: running %d untrusted programs with reward.sandbox_isolation=unsafe "
                        "(no namespaces: the host filesystem is readable, guards are an audit hook, "
                        "see docs/security.md)", len(responses))
        out = list(self._pool.map(self.score, responses, records))
        return RewardResult([s for s, _ in out], [r for _, r in out])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
