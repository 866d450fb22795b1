"""Quiet output on the CPU tier: the known-harmless dependency warnings (docs/cpu.md) are filtered
at start-up, and only those."""
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
