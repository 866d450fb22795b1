"""The launch scripts: every shell script in examples/ and tools/ parses (and passes shellcheck
where it is installed), and examples/launch/multinode.sh really launches a multi-node run."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.test_trainer import CONFIG, TINY, hf_weights, step_records

REPO = Path(__file__).resolve().parents[1]

def _is_shell_script(path: Path) -> bool:
    shebangs = (b"#!/usr/bin/env bash", b"#!/bin/bash", b"#!/bin/sh")
    return path.suffix in (".sh", ".sbatch") or path.read_bytes()[:32].startswith(shebangs)


SCRIPTS = sorted(p for d in ("examples", "tools") for p in (REPO / d).rglob("*") if p.is_file() and _is_shell_script(p))


def test_the_launch_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"multinode.sh", "slurm.sbatch", "setup_env.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt install shellcheck)")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_passes_shellcheck(script):
    proc = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_command(run_dir: Path, *overrides: str) -> tuple[list[str], dict]:
    """multinode.sh for one 'node' of a two-node DP=2 run on 127.0.0.1 (one rank per launcher)."""
    env = {**os.environ, "MASTER": "127.0.0.1", "NNODES": "2", "GPUS_PER_NODE": "1", "PORT": str(_free_port()),
           "RUN_ID": f"loopback-{run_dir.name}", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = ["bash", str(REPO / "examples" / "launch" / "multinode.sh"), str(CONFIG), f"run.output_dir={run_dir.parent}",
           f"run.name={run_dir.name}", f"model.hf_dir={run_dir}/init", *TINY, "parallel.tensor_parallel=1",
           "grpo.micro_batch_size=4", "eval.every=0", "eval.samples=0", "eval.data.max_items=8", *overrides]
    return cmd, env


def _start_node(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _kill_node(node: subprocess.Popen) -> str:
    """SIGKILL a launcher and every process below it: torchrun starts its ranks in sessions of
    their own, so the launcher's process group alone would leave a rank running."""
    try:
        procs = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
    except psutil.Error:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    return node.communicate()[0] or ""


def _finish_nodes(nodes: list[subprocess.Popen], timeout_s: float = 900) -> list[str]:
    """Each launcher's output once all have exited (rc 0 asserted); killed by process group on a timeout."""
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two-node run did not finish in {timeout_s:.0f} s")
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill_node(node)
    assert all(node.returncode == 0 for node in nodes), "\n--- next launcher ---\n".join(
        f"rc {node.returncode}: {out[-5000:]}" for node, out in zip(nodes, outputs))
    return outputs


@pytest.mark.slow
def test_multinode_script_runs_two_nodes_on_loopback(tmp_path):
    """Two launcher processes, one rank each, rendezvous over c10d on 127.0.0.1: a two-'node'
    DP=2 GRPO run through multinode.sh to summary.json."""
    run_dir = tmp_path / "two-nodes"
    cmd, env = _node_command(run_dir, "grpo.steps=1")
    outputs = _finish_nodes([_start_node(cmd, env) for _ in range(2)])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1
    (step,) = step_records(run_dir)
    assert step["skipped"] == 0 and step["sync/probe_abs_diff_mean"] < 1e-4
    config = (run_dir / "config.yaml").read_text()
    assert "tensor_parallel: 1" in config
    assert any("run directory" in out for out in outputs)
    # quiet output (docs/cpu.md): the known-harmless dependency warnings are filtered at start-up
    noise = [line for out in outputs for line in out.splitlines() if "Warning:" in line]
    assert not noise, noise


def _hosts_rendezvous(node: subprocess.Popen, port: int) -> bool:
    """Whether this launcher (torchrun's agent: bash execs it) serves the c10d store on ``port``."""
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(node.pid).net_connections(kind="tcp"))


@pytest.mark.slow
def test_a_two_node_run_survives_a_killed_node(tmp_path):
    """The two-node run of 3 steps, a checkpoint after each, and the same run with the launcher
    that does not host the rendezvous (group rank 1) SIGKILLed with every process below it (agent, rank, writer)
    once step 1's checkpoint is sealed, and a replacement launcher started as a scheduler would:
    the surviving launcher restarts its rank (torchrun --max-restarts), both ranks resume from the
    newest intact checkpoint, and the run ends with the uninterrupted run's final weights."""
    steps = ["grpo.steps=3", "checkpoint.every=1", "grpo.overlong_buffer=3"]
    straight = tmp_path / "straight"
    cmd, env = _node_command(straight, *steps)
    _finish_nodes([_start_node(cmd, env) for _ in range(2)])

    faulty = tmp_path / "faulty"
    cmd, env = _node_command(faulty, *steps)
    port = int(env["PORT"])
    # The survivor hosts the rendezvous (losing the host ends the job) and is group rank 0 before
    # and after the restart: started first, it has the lower pid, by which torch orders the ranks.
    # That is the case that hung until multinode.sh set TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    # (docs/scaling.md, Faults).
    survivor = _start_node(cmd, env)
    deadline = time.monotonic() + 300
    while not _hosts_rendezvous(survivor, port):
        if survivor.poll() is not None or time.monotonic() > deadline:
            pytest.fail("the first launcher never served the rendezvous: " + _kill_node(survivor)[-3000:])
        time.sleep(0.2)
    victim = _start_node(cmd, env)
    nodes = [survivor, victim]
    sealed = faulty / "checkpoints" / "step_000001" / "manifest.json"
    deadline = time.monotonic() + 900
    while not sealed.exists():
        if any(n.poll() is not None for n in nodes) or time.monotonic() > deadline:
            pytest.fail(f"{sealed} never appeared: " + " / ".join(_kill_node(n)[-3000:] for n in nodes))
        time.sleep(0.2)
    (first_rank,) = psutil.Process(survivor.pid).children()
    assert first_rank.environ()["GROUP_RANK"] == "0"
    _kill_node(victim)  # the node is lost
    # the replacement comes once the survivor's rank has failed (its agent then rendezvouses anew)
    psutil.wait_procs([first_rank], timeout=300)
    outputs = _finish_nodes([survivor, _start_node(cmd, env)])
    assert any("restart 1: resuming from" in out for out in outputs), outputs[0][-6000:]
    assert json.loads((faulty / "summary.json").read_text())["steps"] == 3
    assert [r["step"] for r in step_records(faulty)] == [1, 2, 3]
    a, b = hf_weights(straight), hf_weights(faulty)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_more_ranks_than_gpus_on_a_node_is_refused_with_the_reason():
    """On a CUDA machine each rank takes GPU LOCAL_RANK: 2 ranks on a 1-GPU machine are refused in
    one line before set_device(1) fails with a CUDA error."""
    from megadiv.config import ConfigError
    from megadiv.parallel.distributed import check_gpus_per_node

    with pytest.raises(ConfigError, match=r"2 ranks on this node \(LOCAL_WORLD_SIZE\) but 1 CUDA device\(s\) visible"
                                          r".*hide CUDA \(CUDA_VISIBLE_DEVICES=\)"):
        check_gpus_per_node(2, 1)
    check_gpus_per_node(1, 1)
    check_gpus_per_node(4, 8)


def test_cpu_tier_subprocesses_see_no_cuda():
    """The environment test_faults, test_es and tests/torchrun.py give their --nproc launches: no
    CUDA device, so megadiv takes gloo and the CPU path on a GPU machine too."""
    from tests.torchrun import cpu_tier_env

    probe = "import os, torch; print(torch.cuda.is_available(), torch.cuda.device_count(), repr(os.environ['CUDA_VISIBLE_DEVICES']))"
    out = subprocess.run([sys.executable, "-c", probe], env=cpu_tier_env(), capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "0", "''"], out.stderr[-2000:]
    assert cpu_tier_env(OMP_NUM_THREADS="2")["OMP_NUM_THREADS"] == "2"


def test_threads_per_rank_share_the_usable_cores_unless_omp_num_threads_is_set(monkeypatch):
    from megadiv.parallel import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    assert [threads.threads_per_rank(n, environ={}) for n in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]
    assert threads.threads_per_rank(4, environ={"OMP_NUM_THREADS": "3"}) == 3
    assert threads.threads_per_rank(4, environ={"OMP_NUM_THREADS": ""}) == 4  # empty: unset


def test_a_cpu_server_gets_the_cores_the_ranks_leave(monkeypatch):
    """server threads = max(1, usable cores - local ranks x threads per rank); child_env passes it
    to a CPU SGLang server instead of the rank's own OMP_NUM_THREADS."""
    from megadiv.parallel import threads
    from megadiv.rollout.sglang_server import child_env

    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    assert threads.server_threads({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "4"}) == 8
    assert threads.server_threads({"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "4"}) == 1  # none left: one
    assert threads.server_threads({"LOCAL_WORLD_SIZE": "2"}) == 1  # the launcher's rule gives the ranks all 16
    assert threads.server_threads({"OMP_NUM_THREADS": "6"}) == 10  # no torchrun: this process is the one rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert child_env(cuda=False)["OMP_NUM_THREADS"] == "10"
    assert child_env(cuda=True)["OMP_NUM_THREADS"] == "2"  # a GPU server keeps the rank's setting


def test_usable_cores_follow_the_affinity_mask_and_the_cgroup_quota(monkeypatch, tmp_path):
    from megadiv.parallel import threads

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "CPU_MAX", tmp_path / "cpu.max")
    assert threads.usable_cores() == 4  # no cgroup file
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.usable_cores() == 4
    (tmp_path / "cpu.max").write_text("250000 100000\n")  # 2.5 CPUs: 3 threads
    assert threads.usable_cores() == 3
