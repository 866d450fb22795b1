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

# ```python ... ``` (also ```py, ```python3, or a bare ```); the language tag is group 1.
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*)\Z", re.S)
_PYTHON_TAGS = ("python", "python3", "py")


def extract_program(response: str) -> Optional[str]:
    """The program in a response, or None.

    Preference: the last ```python block; else the last untagged ``` block; else, when the response
    was cut inside an open ```python block, the text after it; else the whole response if it is
    valid Python.
    """
    blocks = _FENCE.findall(response)
    for tags in (_PYTHON_TAGS, ("",)):
        chosen = [code for lang, code in blocks if lang.lower() in tags]
        if chosen:
            return chosen[-1] if chosen[-1].strip() else None
    if response.count("```") % 2 == 1:
        tail = _OPEN_FENCE.search(response[response.rfind("```"):])
        return tail.group(1) if tail and tail.group(1).strip() else None
    if not response.strip():
        return None
    try:
        ast.parse(response)
    except (SyntaxError, ValueError):
        return None
    return response


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
