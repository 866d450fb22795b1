"""Run ordinary ``megadiv train`` runs from a driver above the loop, and read what they produced.

A driver (ES, a sweep) turns each candidate into one command line, ``megadiv train`` with the
candidate's overrides and its own ``run.output_dir``/``run.name``, and reads the run's
``summary.json`` when it has ended: the training loop knows nothing of the driver. Runs execute
here one after another or K at a time (:func:`run_parallel`) or as one SLURM job array (:func:`slurm_array`); a
run that died leaves no summary, which the driver records as a failure.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from megadiv.progress import Progress


def train_command(config_args: list[str], output_dir: Path, name: str, overrides: list[str] = (),
                  nproc: int = 1) -> list[str]:
    """``megadiv train CONFIG... key=value...`` writing to ``output_dir/name``, on ``nproc`` local ranks."""
    return [sys.executable, "-m", "megadiv.cli", "train", *config_args, f"run.output_dir={output_dir}",
            f"run.name={name}", *overrides, "--nproc", str(nproc)]


def run_summary(run_dir: Path) -> dict | None:
    """The run's ``summary.json`` (written when training ended), None when there is none."""
    summary = Path(run_dir) / "summary.json"
    return json.loads(summary.read_text()) if summary.is_file() else None


def run_local(command: list[str], log: Path) -> int:
    """Run one candidate, output to ``log`` (:func:`run_parallel` with one job); its exit code."""
    return run_parallel([(command, log)], 1, label="run")[0]


def run_parallel(jobs: list[tuple[list[str], Path]], parallel: int, label: str,
                 progress: Progress | None = None) -> list[int]:
    """Run ``(command, log)`` jobs here in order, at most ``parallel`` at a time; their exit codes.
    ``progress``, if given, advances by one as each job ends (rate and ETA in runs).
    The children stay in this process group, so a signal to the driver's group (Ctrl-C, a kill of
    the group) ends them too, and if the driver alone is stopped the running ones are terminated
    before it exits: nothing trains on in the background."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    codes: dict[int, int] = {}
    running: dict[int, subprocess.Popen] = {}
    pending = list(enumerate(jobs))
    try:
        while pending or running:
            while pending and len(running) < parallel:
                i, (command, log) = pending.pop(0)
                log.parent.mkdir(parents=True, exist_ok=True)
                print(f"{label}: run {i + 1}/{len(jobs)} -> {log}", flush=True)
                with open(log, "ab") as fh:
                    running[i] = subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env)
            for i, proc in list(running.items()):
                if proc.poll() is not None:
                    codes[i] = running.pop(i).returncode
                    if progress is not None:
                        progress.update()
            time.sleep(0.2)
    finally:
        for proc in running.values():
            proc.terminate()
        for proc in running.values():
            proc.wait()
    return [codes[i] for i in range(len(jobs))]


def slurm_array(script: Path, job_name: str, log_pattern: str, commands: dict[int, list[str]], options: str,
                label: str, max_running: int | None = None) -> None:
    """One SLURM job array whose task i runs ``commands[i]`` (one ``megadiv train`` on one node),
    submitted with ``sbatch --wait`` (returns when every task has ended). ``options`` carries
    partition, GPUs, time, account; ``log_pattern`` is sbatch's ``--output`` (%a: the task index);
    ``max_running`` throttles the array (``--array=...%K``)."""
    script.parent.mkdir(parents=True, exist_ok=True)
    cases = "\n".join(f"  {i}) exec {shlex.join(cmd)} ;;" for i, cmd in commands.items())
    throttle = f"%{max_running}" if max_running else ""
    script.write_text(f"#!/bin/bash\n#SBATCH --job-name={job_name}\n"
                      f"#SBATCH --array={','.join(map(str, commands))}{throttle}\n"
                      f"#SBATCH --output={log_pattern}\n"
                      f"cd {shlex.quote(os.getcwd())}\nexport OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}\n"
                      f"case $SLURM_ARRAY_TASK_ID in\n{cases}\nesac\n")
    Path(log_pattern).parent.mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--wait", *shlex.split(options), str(script)]
    print(f"{label}: {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=False)
