"""Rewards: answer extraction, the math-verify pool (timeouts, killed workers), code and exact-match
rewards, the registry and its config."""
import os
import signal
import threading
import time

import pytest

from megadiv.data import DataConfig, Record, load_dataset
from megadiv.rewards import (
    REASONS,
    REWARDS,
    MathVerifyPool,
    RewardConfig,
    RewardResult,
    build_reward,
    extract_program,
    math_scores,
    register_reward,
)
from megadiv.rewards.math_worker import after_hash, extract_answer, last_boxed

pytestmark = pytest.mark.timeout(300)

PATHOLOGICAL = "\\boxed{99999^{99999^{99999}}}"  # sympy would run for ages; math-verify's alarm stops it


@pytest.fixture(scope="module")
def pool():
    # 3 s: an honest item must not time out on a loaded machine; the pathological one never finishes
    with MathVerifyPool(workers=2, timeout_s=3, chunk_size=4) as p:
        yield p


def test_answer_extraction():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\left\\{1, {2}\\right\\}}") == "\\left\\{1, {2}\\right\\}"
    assert last_boxed("\\fbox{7}") == "7" and last_boxed("\\boxed{unclosed") is None and last_boxed("no") is None
    assert after_hash("work\n#### 1,000\n") == "1,000" and after_hash("#### ") is None and after_hash("x") is None
    assert extract_answer("#### 5 and \\boxed{6}", "auto") == ("\\boxed{6}", True)
    assert extract_answer("#### 5", "auto") == ("5", True) and extract_answer("#### 5", "boxed") == (None, False)
    assert extract_answer("it is 5", "auto") == ("it is 5", False) and extract_answer("it is 5", "hash") == (None, False)


def test_math_pool_grades_with_reasons(pool):
    cases = [("The answer is \\boxed{\\frac12}.", "0.5", "correct"), ("so it is 0.5", "\\frac{1}{2}", "correct"),
             ("#### $1,000", "1000", "correct"), ("\\boxed{50\\%}", "0.5", "correct"),
             ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", "correct"),
             ("\\boxed{7}", "8", "wrong"), ("no answer here", "3", "unparsable"), ("\\boxed{}", "3", "unparsable"),
             (PATHOLOGICAL, "1", "timeout")]
    grades = pool.grade([c[0] for c in cases], [c[1] for c in cases])
    assert [g.reason for g in grades] == [c[2] for c in cases]
    assert [g.correct for g in grades] == [c[2] == "correct" for c in cases]
    strict = pool.grade(["so it is 0.5", "\\boxed{3}", "#### 3"], ["0.5", "3", "3"], "boxed")
    assert [(g.correct, g.formatted, g.reason) for g in strict] == [
        (False, False, "unparsable"), (True, True, "correct"), (False, False, "unparsable")]
    assert pool.grade([], []) == []
    with pytest.raises(ValueError, match="2 responses but 1 golds"):
        pool.grade(["a", "b"], ["1"])


def test_math_pool_survives_killed_workers(pool):
    gsm = load_dataset(DataConfig(name="gsm8k", split="test", max_items=24))
    responses, golds = [r.solution for r in gsm], [r.answer for r in gsm]
    # Idle kill: the dead worker is found when work is sent to it.
    os.kill(pool.pids()[0], signal.SIGKILL)
    time.sleep(0.2)
    assert [g.reason for g in pool.grade(responses, golds)] == ["correct"] * 24
    # Kill mid-batch: the pathological item keeps one worker busy for ~1 s; both workers die while
    # the batch runs. Their chunks are re-run item by item in fresh workers.
    restarts, before = pool.restarts, set(pool.pids())
    killer = threading.Timer(0.4, lambda: [os.kill(pid, signal.SIGKILL) for pid in pool.pids()])
    killer.start()
    grades = pool.grade([PATHOLOGICAL] + responses, ["1"] + golds)
    killer.join()
    assert [g.reason for g in grades[1:]] == ["correct"] * 24
    assert grades[0].reason in ("timeout", "crashed") and not grades[0].correct
    assert pool.restarts >= restarts + 2 and not before & set(pool.pids())
    # And the pool is whole afterwards.
    assert all(g.correct for g in pool.grade(responses, golds))


def test_math_scores_public_api():
    assert math_scores(["#### 72", "\\boxed{71}", "nothing"], ["72", "72", "72"]) == [1.0, 0.0, 0.0]


def test_math_reward_from_registry_with_format_weight():
    records = [Record(id=str(i), prompt="p", answer="4") for i in range(4)]
    reward = build_reward(RewardConfig(name="math", workers=1, format_weight=0.1))
    try:
        result = reward(["\\boxed{4}", "it is 4", "\\boxed{5}", "hmm"], records)
    finally:
        reward.close()
    assert result.scores == [1.1, 1.0, 0.1, 0.0]
    assert result.reasons == ["correct", "correct", "wrong", "unparsable"]
    assert result.counts() == {"correct": 2, "wrong": 1, "unparsable": 1, "timeout": 0, "crashed": 0}


def test_extract_program():
    assert extract_program("Here:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"
    two = "```python\nx = 1\n```\ntext\n```py\ndef g(): pass\n```"
    assert extract_program(two) == "def g(): pass\n"  # the last python block
    assert extract_program("```\ndef h(): pass\n```") == "def h(): pass\n"
    assert extract_program("```text\nnot code\n```\n```python\ndef k(): pass\n```") == "def k(): pass\n"
    assert extract_program("I think:\n```python\ndef cut(n):\n    return n") == "def cut(n):\n    return n"
    assert extract_program("def bare(x):\n    return x\n") == "def bare(x):\n    return x\n"
    for nothing in ("", "   ", "This is prose, not code.", "```python\n\n```"):
        assert extract_program(nothing) is None


def test_code_reward_on_mbpp_items():
    ds = load_dataset(DataConfig(name="mbpp", split="test", max_items=3))
    good = [f"Sure.\n```python\n{r.solution}\n```" for r in ds]
    responses = good + ["", "```python\ndef remove_Occ(s, ch):\n    return s\n```",
                        "```python\ndef remove_Occ(s, ch):\n    while True:\n        pass\n```"]
    records = list(ds) + [ds[0]] * 3
    reward = build_reward(RewardConfig(name="mbpp", workers=2, timeout_s=3))
    try:
        result = reward(responses, records)
    finally:
        reward.close()
    assert result.scores == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert result.reasons == ["correct"] * 3 + ["unparsable", "wrong", "timeout"]
    # Partial credit: remove_Occ returning s unchanged passes none of 3; one right answer in 3:
    partial = build_reward(RewardConfig(name="code", workers=1, partial_credit=True))
    try:
        half = "```python\ndef remove_Occ(s, ch):\n    return 'heo'\n```"
        assert partial([half], [ds[0]]).scores == [pytest.approx(1 / 3)]
    finally:
        partial.close()


def test_exact_match_reward():
    reward = build_reward(RewardConfig(name="exact_match"))
    records = [Record(id=str(i), prompt="17+25=", answer="42") for i in range(4)]
    result = reward([" 42\n", "41", "", "420"], records)
    assert result.scores == [1.0, 0.0, 0.0, 0.0] and result.reasons == ["correct", "wrong", "unparsable", "wrong"]


def test_reward_config_and_registry():
    with pytest.raises(ValueError, match="unknown reward 'mathh'"):
        RewardConfig(name="mathh")
    for bad, key in ((dict(workers=0), "reward.workers"), (dict(timeout_s=0), "reward.timeout_s"),
                     (dict(format_weight=-1), "reward.format_weight"),
                     (dict(sandbox_memory_mb=10), "reward.sandbox_memory_mb")):
        with pytest.raises(ValueError, match=key):
            RewardConfig(**bad)
    register_reward("always_one", lambda cfg: (lambda responses, records: RewardResult([1.0] * len(responses),
                                                                                      ["correct"] * len(responses))))
    try:
        assert build_reward(RewardConfig(name="always_one"))(["a"], [None]).scores == [1.0]
        with pytest.raises(ValueError, match="already registered"):
            register_reward("always_one", lambda cfg: None)
    finally:
        del REWARDS["always_one"]
    with pytest.raises(ValueError, match="unknown reason codes"):
        RewardResult([0.0], ["maybe"])
    assert REASONS == ("correct", "wrong", "unparsable", "timeout", "crashed")


def test_pool_that_cannot_start_fails_fast(monkeypatch, tmp_path):
    broken = tmp_path / "broken_worker.py"
    broken.write_text("import sys\nsys.exit(1)\n")
    monkeypatch.setattr("megadiv.rewards.math_reward.WORKER", str(broken))
    with pytest.raises(RuntimeError, match="exited during start-up"):
        MathVerifyPool(workers=1)
    silent = tmp_path / "silent_worker.py"
    silent.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr("megadiv.rewards.math_reward.WORKER", str(silent))
    with pytest.raises(RuntimeError, match="did not start within 1"):
        MathVerifyPool(workers=1, start_timeout_s=1)


def test_last_number_reward_is_the_gbmpo_authors():
    reward = build_reward(RewardConfig(name="last_number"))
    gold = [Record(id="g", prompt="", answer="1234")] * 6
    result = reward(["so 1,234 apples", "1234.0", "1234.1 then 1234", "1234.2", "12 and 1233", "no number"], gold)
    # last number, commas dropped, |x - 1234| <= 1e-4 * 1234 (0.1234): 1234.1 is wrong only as the last
    assert result.scores == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert result.reasons == ["correct"] * 3 + ["wrong", "wrong", "unparsable"]
    assert reward(["-3.5"], [Record(id="f", prompt="", answer="-7/2")]).scores == [1.0]
    with pytest.raises(ValueError, match="format_weight applies to the math reward"):
        RewardConfig(name="last_number", format_weight=0.1)
    with pytest.raises(ValueError, match="partial_credit applies to the code reward"):
        RewardConfig(name="code_shaped", partial_credit=True)


def test_shaped_code_reward_terms_by_hand():
    """Each term of the GBMPO authors' MBPP reward (megadiv/rewards/gbmpo.py), computed by hand."""
    task = load_dataset(DataConfig(name="mbpp", split="test", max_items=1))[0]  # remove_Occ, 3 tests
    right = "def remove_Occ(s,ch):\n    return s.replace(ch, '', 1)[::-1].replace(ch, '', 1)[::-1]"
    fenced = f"```python\n{right}\n```"                       # all pass, one banned token (```)
    aliased = "def strip_it(s, ch):\n    return 'heo'"          # aliased to remove_Occ; passes 1 of 3
    responses = [fenced, fenced, aliased, "def remove_Occ(s, ch):\n    while True: pass",
                 "def remove_Occ(s, ch) return", "def remove_Occ(s, ch):\n    return s  # \u00e9"]
    reward = build_reward(RewardConfig(name="code_shaped", workers=2, timeout_s=3))
    try:
        result = reward(responses, [task] * 6)
        wrong = "def remove_Occ(s, ch):\n    return s"
        tied = reward([wrong + "\n", wrong, wrong + "\n\n"], [task] * 3)  # one group, all -0.10 before group terms
    finally:
        reward.close()
    brief = 0.0 if len(fenced) >= 150 else (0.02 if len(fenced) < 100 else 0.01)
    expected = [1.0 - 0.02 + brief,            # all tests, ``` penalty, brevity by length
                1.0 - 0.02 + brief - 0.02,     # the same text again: duplicate
                1 / 3 + 0.02,                  # one test of three, under 100 characters
                -0.25,                         # timeout
                -0.10,                         # syntax error: ran, none passed
                0.0 - 0.10 - 0.03]             # none passed, non-ASCII
    assert result.scores == pytest.approx([min(1.0, e) for e in expected], abs=1e-12)
    assert result.reasons == ["correct", "correct", "wrong", "timeout", "wrong", "wrong"]
    # tie-break in a uniform group by length rank: shortest +0.015, middle 0, longest -0.015
    assert tied.scores == pytest.approx([-0.10, -0.10 + 0.015, -0.10 - 0.015], abs=1e-12)


# Degenerate responses: nested text the parser refuses with RecursionError or MemoryError rather
# than SyntaxError (3,000 unary minuses already), and operator chains it parses slowly but fine.
DEEP_SHAPES = {"unary": lambda n: "-" * n + "1", "not": lambda n: "not " * n + "x",
               "binary": lambda n: "1" + " + 1" * n, "attribute": lambda n: "a" + ".b" * n,
               "call": lambda n: "f" + "()" * n, "subscript": lambda n: "a" + "[0]" * n,
               "lambda": lambda n: "lambda: " * n + "0", "power": lambda n: "2" + "**2" * n,
               "parens": lambda n: "(" * n + "1" + ")" * n}


def test_deep_responses_score_nothing_and_raise_nothing():
    task = load_dataset(DataConfig(name="mbpp", split="test", max_items=1))[0]
    bare = [shape(n) for shape in DEEP_SHAPES.values() for n in (1000, 3000, 6000, 20000)]
    fenced = [f"```python\n{shape(n)}\n```" for shape in DEEP_SHAPES.values() for n in (3000, 20000)]
    for name in ("code", "code_shaped"):
        reward = build_reward(RewardConfig(name=name, workers=2, timeout_s=5))
        try:
            result = reward(bare + fenced, [task] * (len(bare) + len(fenced)))
        finally:
            reward.close()
        # code: 0 each; code_shaped: its no-test-passed term, never credit
        assert all(s == 0.0 if name == "code" else s <= 0.0 for s in result.scores), (name, result)
        assert "correct" not in result.reasons, (name, result.reasons)


def test_an_open_fence_and_whitespace_cost_linear_time():
    """An open fence followed by whitespace (the shaped reward's old regex backtracked cubically
    on it: 14 s for 3,000 newlines): under 50 ms at 10,000 characters, and 10x the text costs
    about 10x the time (best of 5, so that a loaded machine does not decide)."""
    from megadiv.rewards.gbmpo import authors_program

    def cost(text):
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            extract_program(text)
            authors_program(text)
            best = min(best, time.perf_counter() - start)
        return best

    for opening in ("```python", "```", "```python\n", "<think>```python", "```python\n```\n```"):
        for ws in ("\n", " ", "\t", " \n"):
            short, long = (opening + ws * (n // len(ws)) for n in (10_000, 100_000))
            assert cost(short) < 0.05, (opening, ws, cost(short))
            assert cost(long) < 30 * max(cost(short), 1e-4), (opening, ws, cost(short), cost(long))
