"""Math-verify worker process: ``python math_worker.py``, one per pool slot (megadiv.rewards.math).

math-verify times out parsing and comparison with ``signal.alarm``, which works only in the main
thread of a process, so grading runs here, in the main thread of a dedicated process. Standard
library plus math_verify only; never imports megadiv.

Protocol, one JSON object per line: request on stdin
``{"items": [[response, gold], ...], "answer_format": "auto", "timeout_s": 5}``, reply on stdout
``{"results": [[correct, formatted, reason], ...]}`` with reason in correct / wrong / unparsable /
timeout. Anything a library prints goes to stderr, never into the protocol stream.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import Optional


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    while start >= 0:
        brace = text.find("{", start)
        if brace >= 0 and text[start:brace].strip() in ("\\boxed", "\\fbox"):
            depth = 0
            for i in range(brace, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[brace + 1:i]
        start = max(text.rfind("\\boxed", 0, start), text.rfind("\\fbox", 0, start))
    return None


def after_hash(text: str) -> Optional[str]:
    """The first line after the last ``####`` (GSM8K's answer marker); None if absent or empty."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    line = text[pos + 4:].strip().split("\n", 1)[0].strip()
    return line or None


def extract_answer(response: str, answer_format: str) -> tuple[Optional[str], bool]:
    """(text for math-verify to parse, whether the response used the required format).

    boxed / hash: only that format counts. auto: the last \\boxed{}, else the text after the last
    ####, else the whole response (math-verify then finds the answer itself; formatted=False).
    """
    if answer_format in ("boxed", "auto"):
        boxed = last_boxed(response)
        if boxed is not None:
            return "\\boxed{" + boxed + "}", True
        if answer_format == "boxed":
            return None, False
    hashed = after_hash(response)
    if hashed is not None:
        return hashed, True
    return (response, False) if answer_format == "auto" else (None, False)


def grade(response: str, gold: str, answer_format: str, timeout_s: int) -> tuple[bool, bool, str]:
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    text, formatted = extract_answer(response, answer_format)
    if text is None:
        return False, formatted, "unparsable"
    try:
        gold_parsed = parse_gold(gold, timeout_s)
        pred = parse(text, parsing_timeout=timeout_s, raise_on_error=True)
        if not pred:
            return False, formatted, "unparsable"
        ok = verify(gold_parsed, pred, timeout_seconds=timeout_s, raise_on_error=True)
    except TimeoutException:
        return False, formatted, "timeout"
    except Exception:  # sympy can raise nearly anything on odd input: that answer is unusable
        return False, formatted, "unparsable"
    return bool(ok), formatted, "correct" if ok else "wrong"


@functools.lru_cache(maxsize=4096)
def parse_gold(gold: str, timeout_s: int):
    """Parse a gold answer once: GRPO grades G responses per prompt against the same gold."""
    from math_verify import parse

    return parse("\\boxed{" + gold + "}", parsing_timeout=timeout_s, raise_on_error=True)


def main() -> None:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (libraries, warnings) must not corrupt the protocol
    import math_verify  # noqa: F401  (import before the first request: its cost is start-up)

    proto.write('{"ready": true}\n')
    proto.flush()
    for line in sys.stdin:
        req = json.loads(line)
        results = [grade(r, g, req["answer_format"], req["timeout_s"]) for r, g in req["items"]]
        proto.write(json.dumps({"results": results}) + "\n")
        proto.flush()


if __name__ == "__main__":
    main()
