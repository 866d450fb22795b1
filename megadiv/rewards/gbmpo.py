"""The GBMPO authors' rewards, as options beside megadiv's own (Lexsi-Labs/aligntune,
src/aligntune/backends/trl/rl/meta_es; every constant below is theirs).

``last_number`` (GSM8K; train_nmdrgrpo_es_math.py): 1 when the last number in the response
(thousands commas removed, ``-?\\d+(\\.\\d+)?``) equals the gold answer within relative 1e-4 /
absolute 1e-8, else 0. No answer format is required, unlike the ``math`` reward.

``code_shaped`` (MBPP; train_nmdrgrpo_code.py), per response, then per group of a prompt's responses:

    program   the first ```python block, else the first ``` block, else the response (less <think>
              blocks and a leading "Solution:"-style phrase); when the function the tests call is not
              defined, the first defined function is aliased to its name
    base      passed / total tests; - 0.10 when none passed; a program that does not run to its
              tests: -0.25 on a timeout, -0.15 otherwise (crash, resource limit); a syntax error
              counts as running with no test passed (-0.10), as their compile gate makes it
    format    - 0.02 for each of ``` / print( / input( / Example: / Explanation: / # Example /
              # Test found in the response; - 0.03 when it has a non-ASCII character
    brevity   + 0.02 under 100 characters, + 0.01 under 150, when some test passed
    duplicate - 0.02 for a response identical to an earlier one of its group
    tie-break when the group's rewards (before the duplicate term) have std < 1e-6: + 0.015 for
              the shortest response down to - 0.015 for the longest, linearly by length rank
    clip      to [-0.5, 1.0]

Not reproduced: their wrapper that drops surplus positional arguments at call time, and their
rewriting of typographic characters to ASCII before running. A response counts as ``correct``
(pass@1) when every test passed, whatever its shaped score.
"""
from __future__ import annotations

import math
import re
import statistics
from typing import Optional, Sequence

from megadiv.rewards.base import RewardResult
from megadiv.rewards.code_reward import CodeReward, is_python
from megadiv.rewards.sandbox import run_sandboxed

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> Optional[str]:
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def numbers_equal(pred: str, gold: str) -> bool:
    """Numeric comparison with the authors' tolerances; a gold 'a/b' is read as a fraction."""
    gold = gold.strip().replace(",", "")
    try:
        value = float(gold) if "/" not in gold else float(gold.split("/")[0]) / float(gold.split("/")[1])
        return math.isclose(float(pred), value, rel_tol=1e-4, abs_tol=1e-8)
    except (ValueError, ZeroDivisionError):
        return pred.strip() == gold


class LastNumberReward:
    """The authors' GSM8K reward (module docstring)."""

    def __call__(self, responses: Sequence[str], records: Sequence) -> RewardResult:
        scores, reasons = [], []
        for response, record in zip(responses, records, strict=True):
            pred = last_number(response)
            ok = pred is not None and numbers_equal(pred, str(record.answer))
            scores.append(float(ok))
            reasons.append("correct" if ok else "wrong" if pred is not None else "unparsable")
        return RewardResult(scores, reasons)

    def close(self) -> None:
        pass


_PREFIXES = ("Here's the solution:", "Here's a Python function:", "The Python code is:", "Solution:")
_BANNED = ("```", "print(", "input(", "Example:", "Explanation:", "# Example", "# Test")
_CALL = re.compile(r"(\w+)\s*\([^)]*\)")
_DEF = re.compile(r"\bdef\s+([A-Za-z_]\w*)\s*\(")


def between(text: str, opening: str, closing: str, pos: int = 0) -> Optional[tuple[int, int]]:
    """(start, end) of the text between the first ``opening`` at or after ``pos`` and the next
    ``closing``, or None: what the lazy ``opening(.*?)closing`` finds first, by a linear scan (that
    regex, with ``\\s*`` on both sides as the authors wrote it, backtracks cubically on an open fence
    followed by whitespace)."""
    start = text.find(opening, pos)
    end = text.find(closing, start + len(opening)) if start >= 0 else -1
    return (start + len(opening), end) if end >= 0 else None


def authors_program(response: str) -> str:
    """The program the authors' extraction takes from a response (module docstring)."""
    kept, pos = [], 0
    while (think := between(response, "<think>", "</think>", pos)) is not None:  # drop <think> blocks
        kept.append(response[pos:think[0] - len("<think>")])
        pos = think[1] + len("</think>")
    text = re.sub(r"/think|/no_think", "", "".join(kept) + response[pos:])
    for opening in ("```python", "```"):
        block = between(text, opening, "```")
        if block is not None:
            return text[block[0]:block[1]].strip()
    text = text.strip()
    for prefix in _PREFIXES:
        if text.lower().startswith(prefix.lower()):
            text = text[len(prefix):].strip()
    return text


def with_entrypoint(program: str, name: str) -> str:
    """Alias the first defined function to ``name`` when the program does not define ``name``."""
    if re.search(rf"\bdef\s+{re.escape(name)}\s*\(", program):
        return program
    first = _DEF.search(program)
    return program + f"\n\n{name} = {first.group(1)}\n" if first else program


class ShapedCodeReward(CodeReward):
    """The authors' shaped MBPP reward (module docstring); sandboxes as the ``code`` reward."""

    def score(self, response: str, record) -> tuple[float, str]:
        call = _CALL.search(record.tests[0]) if record.tests else None
        if call is None:
            return -0.10, "unparsable"
        program = with_entrypoint(authors_program(response), call.group(1))
        if not is_python(program):
            passed, total, status = 0, len(record.tests), "failed"
        else:
            result = run_sandboxed(program, record.tests, self.timeout_s, setup=record.test_setup,
                                   program_names=record.program_names, limits=self.limits)
            passed, total, status = result.passed, result.total, result.status
        ran = status in ("passed", "failed")
        base = passed / total - (0.10 if passed == 0 else 0.0)
        if not ran:
            base = -0.25 if status == "timeout" else -0.15
        fmt = -0.02 * sum(token in response for token in _BANNED) - (0.0 if response.isascii() else 0.03)
        brevity = (0.02 if len(response) < 100 else 0.01 if len(response) < 150 else 0.0) if passed and ran else 0.0
        reason = {"passed": "correct", "failed": "wrong", "timeout": "timeout"}.get(status, "crashed")
        return base + fmt + brevity, reason

    def __call__(self, responses: Sequence[str], records: Sequence) -> RewardResult:
        result = super().__call__(responses, records)
        return RewardResult(group_terms(result.scores, list(responses), [r.id for r in records]), result.reasons)


def group_terms(scores: list[float], responses: list[str], group_ids: list[str]) -> list[float]:
    """Duplicate penalty and tie-break within each run of equal ``group_ids`` (a prompt's group),
    then the clip to [-0.5, 1.0]."""
    out = list(scores)
    start = 0
    while start < len(out):
        end = start
        while end < len(out) and group_ids[end] == group_ids[start]:
            end += 1
        group = range(start, end)
        seen = set()
        for i in group:
            if responses[i] in seen:
                out[i] -= 0.02
            seen.add(responses[i])
        n = len(group)
        if n > 1 and statistics.pstdev(scores[start:end]) < 1e-6:
            for rank, i in enumerate(sorted(group, key=lambda i: len(responses[i]))):
                out[i] += 0.03 * (n - rank - 1) / (n - 1) - 0.015
        start = end
    return [min(1.0, max(-0.5, s)) for s in out]
