"""Every command in docs/install.md: each bash block parses (``bash -n``), and each megadiv run it
starts (``megadiv train ... --nproc N``, ``multinode.sh`` on ``--nodes`` x ``--gpus-per-node``)
passes ``megadiv check-config`` at that world size, with examples/hf_configs standing in for the
checkpoint; the SLURM-in-container example calls no SLURM tool inside the image."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "docs" / "install.md"


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", INSTALL.read_text(), flags=re.S)


def runs() -> list[tuple[list[str], int]]:
    """(config arguments, world size) of every megadiv run the blocks start."""
    out = []
    for block in bash_blocks():
        text = block.replace("\\\n", " ")
        for match in re.finditer(r"megadiv train (.*?)['\"]?$", text, flags=re.M):
            args = shlex.split(match.group(1).rstrip("'"))
            nproc = int(args[args.index("--nproc") + 1])
            out.append(([a for i, a in enumerate(args) if a != "--nproc" and args[i - 1] != "--nproc"], nproc))
        for match in re.finditer(r"bash examples/launch/multinode\.sh (.*?)\"?$", text, flags=re.M):
            if match.group(1).startswith('"$@'):
                continue                                  # slurm.sbatch passes its own arguments
            nodes = int(re.search(r"--nodes=(\d+)", text).group(1))
            gpus = int(re.search(r"--gpus-per-node=(\d+)", text).group(1))
            out.append((shlex.split(match.group(1).rstrip('"')), nodes * gpus))
    return out


def test_every_block_parses():
    blocks = bash_blocks()
    assert len(blocks) == 5          # lock install, docker build, one node, enroot, Apptainer
    for block in blocks:
        proc = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, (block, proc.stderr)


def test_the_slurm_container_example_reads_node_0_on_the_host():
    """scontrol is not in the image: it must run before srun, not inside the container's bash -c."""
    block = next(b for b in bash_blocks() if "--container-image" in b)
    host, inside = block.split("--container-image", 1)
    assert "scontrol" in host and "scontrol" not in inside


@pytest.mark.parametrize("args, world_size", runs(), ids=["one-node", "enroot"])
def test_every_megadiv_run_passes_check_config(args, world_size, tmp_path):
    assert len(runs()) == 2          # the one-node and the enroot runs
    proc = subprocess.run([sys.executable, "-m", "megadiv.cli", "check-config", *args, f"run.output_dir={tmp_path}",
                           "--world-size", str(world_size)], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
