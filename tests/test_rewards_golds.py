"""Math rewards against golds that do not come from the code under test: GSM8K's numeric answers
parsed here from the raw JSONL (not through megadiv.data), and MATH-500 answers rewritten by hand
in other but equivalent forms (and near misses that must be wrong)."""
import json
import re
from decimal import Decimal

import pytest

from megadiv.data import DataConfig, load_dataset
from megadiv.data.datasets import FILES
from megadiv.rewards import MathVerifyPool

pytestmark = pytest.mark.timeout(300)


def gsm8k_golds_parsed_here(split: str) -> list[Decimal]:
    """The number after the last '####' of each raw answer, commas dropped, as an exact Decimal."""
    golds = []
    for line in (FILES / "gsm8k" / f"{split}.jsonl").read_text().splitlines():
        match = re.search(r"####\s*(-?[\d,]*\.?\d+)\s*$", json.loads(line)["answer"])
        golds.append(Decimal(match.group(1).replace(",", "")))
    return golds


@pytest.fixture(scope="module")
def pool():
    with MathVerifyPool(workers=2, timeout_s=3, chunk_size=8) as p:
        yield p


def test_gsm8k_golds_agree_with_an_independent_parse(pool):
    records = load_dataset(DataConfig(name="gsm8k", split="test"))
    golds = gsm8k_golds_parsed_here("test")
    assert len(records) == len(golds) == 1319
    assert all(Decimal(r.answer) == g for r, g in zip(records, golds))       # every item, exactly
    # the reward: a boxed independent gold is correct, the gold + 1 is wrong, a gold with thousands
    # separators or a trailing ".00" in the "#### " form is still correct
    items = list(zip(records, golds))[:40]
    responses = ([f"So the total is \\boxed{{{g}}}." for _, g in items] + [f"\\boxed{{{g + 1}}}" for _, g in items]
                 + [f"#### {g:,}.00" if g == g.to_integral_value() else f"#### {g}" for _, g in items])
    answers = [r.answer for r, _ in items] * 3
    grades = pool.grade(responses, answers)
    assert [g.correct for g in grades] == [True] * 40 + [False] * 40 + [True] * 40


# (unique_id, an equivalent form written by hand, a near miss)
MATH500_FORMS = [
    ("test/precalculus/807.json", "(3, \\frac{\\pi}{2})", "(3, \\pi)"),
    ("test/algebra/2584.json", "\\dfrac{14}{3}", "\\frac{14}{5}"),
    ("test/algebra/2036.json", "\\sqrt{117}", "\\sqrt{113}"),
    ("test/intermediate_algebra/1197.json", "\\frac{6}{112}", "\\frac{3}{65}"),
    ("test/precalculus/990.json", "-5i + 6", "6 + 5i"),
    ("test/prealgebra/1302.json", "11\\sqrt{2}", "11\\sqrt{3}"),
    ("test/algebra/1072.json", "0.3888", "0.3889"),
    ("test/precalculus/927.json", "90", "45"),
    ("test/number_theory/1032.json", "2,220", "2,202"),
]


def test_math500_answers_in_equivalent_forms(pool):
    by_id = {r.id.removeprefix("math500/"): r for r in load_dataset(DataConfig(name="math500", split="test"))}
    golds = [by_id[uid].answer for uid, _, _ in MATH500_FORMS]
    right = pool.grade([f"The answer is \\boxed{{{eq}}}." for _, eq, _ in MATH500_FORMS], golds)
    wrong = pool.grade([f"The answer is \\boxed{{{miss}}}." for _, _, miss in MATH500_FORMS], golds)
    assert [g.reason for g in right] == ["correct"] * len(MATH500_FORMS), list(zip(MATH500_FORMS, golds))
    assert [g.reason for g in wrong] == ["wrong"] * len(MATH500_FORMS)
