"""benchmarks/bench_token_budget.py in its quickest form (a one-layer model, 8 rows, one timed step
per path), so that the script cannot rot unseen: both batches print their fed tokens and ratios."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def test_token_budget_benchmark_runs_and_prints_the_ratios():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_token_budget.py"), "--rows", "8",
                          "--max-response", "40", "--hidden", "32", "--layers", "1", "--ffn", "64", "--vocab", "300",
                          "--repeats", "1"], capture_output=True, text=True, timeout=240, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    fed = re.findall(r"^ *(uniform|log-uniform): trained tokens (\d+); fed tokens padded (\d+), budget (\d+)",
                     out.stdout, re.M)
    assert [f[0] for f in fed] == ["uniform", "log-uniform"], out.stdout
    for _, trained, padded, budget in fed:  # the budget feeds fewer tokens than padding, never fewer than the rows
        assert int(trained) <= int(budget) < int(padded) == 8 * (16 + 40)
    assert len(re.findall(r"cpu tokens/s: padded \d+, budget \d+, ratio [\d.]+x", out.stdout)) == 2
