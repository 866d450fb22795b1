"""benchmarks/bench_rewards.py's sandbox comparison in its quickest form (this tree's sandbox
against HEAD's, loaded beside it in one process, a few MBPP references in unsafe mode) so that
the script cannot rot unseen: the baseline loader must find every module the old sandbox imports."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                                capture_output=True).returncode != 0, reason="needs the git checkout")]


def test_sandbox_comparison_against_a_revision_runs_and_prints_the_ratio():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_rewards.py"), "--baseline", "HEAD",
                          "--mbpp-items", "3", "--rounds", "2", "--workers", "1", "--isolation", "unsafe"],
                         capture_output=True, text=True, timeout=240, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(re.findall(r"^round \d: this tree [\d.]+/s, HEAD [\d.]+/s, ratio [\d.]+$", out.stdout, re.M)) == 2
    assert re.search(r"3 MBPP references, 1 workers, unsafe: .* median ratio [\d.]+ \(per round", out.stdout), out.stdout
