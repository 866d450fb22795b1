"""Quiet output on the CPU tier: the known-harmless dependency warnings (docs/cpu.md) are filtered
at start-up, and only those."""
import os
import subprocess
import sys

import pytest
import torch

IMPORTS = "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs; import warnings; " \
          "warnings.warn('a warning megadiv does not know', UserWarning)"


def _stderr(quiet: bool) -> str:
    prefix = "from megadiv.parallel.quiet import quiet_known_warnings; quiet_known_warnings(); " if quiet else ""
    proc = subprocess.run([sys.executable, "-c", prefix + IMPORTS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the filter is for the CPU tier only")
def test_known_harmless_warnings_are_filtered_and_others_are_not():
    loud, quiet = _stderr(quiet=False), _stderr(quiet=True)
    for known in ("Apex is not installed", "Transformer Engine and Apex are not installed"):
        assert known in loud and known not in quiet
    assert "a warning megadiv does not know" in quiet


def test_dependency_future_warnings_progress_bars_and_the_switch_to_see_everything():
    code = ("from megadiv.parallel.quiet import quiet_known_warnings; quiet_known_warnings(); import warnings; "
            "warnings.warn_explicit('deprecated inside torch', FutureWarning, 'x.py', 1, module='torch.nn'); "
            "warnings.warn_explicit('deprecated in user code', FutureWarning, 'y.py', 1, module='mine'); "
            "from transformers.utils import logging as l; print(l.is_progress_bar_enabled())")
    env = {k: v for k, v in os.environ.items() if k != "MEGADIV_ALL_WARNINGS"}
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, "MEGADIV_ALL_WARNINGS": "1"})
    assert quiet.returncode == loud.returncode == 0, quiet.stderr + loud.stderr
    assert "deprecated inside torch" not in quiet.stderr and "deprecated in user code" in quiet.stderr
    assert quiet.stdout.strip() == "False"  # transformers' progress bars off
    assert "deprecated inside torch" in loud.stderr and loud.stdout.strip() == "True"
