"""Run a test body on N ranks under ``torchrun`` (gloo, CUDA hidden) and collect per-rank results.

A body is a plain function ``body(ctx) -> value`` in an importable module under ``tests/``.
Each rank calls it once; what it returns (anything picklable) comes back to the test as
``results[rank]``. A launch costs seconds of imports, so a body should run many checks and
return them all (e.g. a dict of named figures) for the test functions to assert on.

Failure modes are the point of this module: a rank that raises, dies, or hangs fails the test
with that rank's traceback and log tail; a hang is cut by ``timeout_s`` and the whole process
group (torchrun and every rank) is killed, so nothing outlives the test.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class DistributedTestError(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_tier_env(**extra: str) -> dict[str, str]:
    """The environment of a CPU-tier subprocess (a torchrun, ``megadiv train --nproc N``): this
    repository first on PYTHONPATH, one OpenMP thread unless set, and no CUDA device, so that
    megadiv picks gloo and the CPU code path on a GPU machine too (there, N ranks on one visible
    GPU would fail in ``torch.cuda.set_device(1)``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return {**env, **extra}


def run_torchrun(target: str, nproc: int, timeout_s: float = 300.0, args: dict | None = None,
                 cuda: bool = False) -> list:
    """Run ``target`` ("tests.dist.module:function") on ``nproc`` ranks; return per-rank results.

    The ranks see no GPU unless ``cuda`` (the ``gpu`` tests): megadiv.parallel picks gloo and the
    CPU tier's code path, as in CI, even on a GPU machine, where NCCL would otherwise refuse 2-4
    ranks on its one GPU."""
    with tempfile.TemporaryDirectory(prefix="megadiv-dist-") as tmp:
        tmp = Path(tmp)
        (tmp / "args.pkl").write_bytes(pickle.dumps(args or {}))
        env = cpu_tier_env()
        if cuda:   # the gpu tests: the GPUs this process sees
            env.pop("CUDA_VISIBLE_DEVICES")
            env.update({k: v for k, v in os.environ.items() if k == "CUDA_VISIBLE_DEVICES"})
            # float32 compared at float32 tolerances: no TF32 in any CUDA library, Transformer
            # Engine's own GEMMs included (TE takes float32 GEMMs in TF32 whatever torch's flags say)
            env["NVIDIA_TF32_OVERRIDE"] = "0"
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={nproc}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
            "--redirects=3", f"--log_dir={tmp / 'logs'}", "--tee=0",
            str(REPO / "tests" / "_rank_entry.py"), target, str(tmp),
        ]
        log_path = tmp / "torchrun.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
            try:
                rc = proc.wait(timeout=timeout_s)
                hung = False
            except subprocess.TimeoutExpired:
                hung = True
                rc = None
            finally:
                _kill_group(proc)

        results, failures = [], []
        for rank in range(nproc):
            out = tmp / f"rank{rank}.pkl"
            if out.exists():
                ok, value = pickle.loads(out.read_bytes())
                if ok:
                    results.append(value)
                    continue
                failures.append(f"rank {rank} raised:\n{value}")
            else:
                failures.append(f"rank {rank} returned nothing (died or hung)")
            results.append(None)
        if hung or rc != 0 or failures:
            head = f"timed out after {timeout_s:.0f}s" if hung else f"torchrun exit code {rc}"
            raise DistributedTestError(
                f"{target} on {nproc} ranks: {head}\n" + "\n".join(failures)
                + "\n--- log tail ---\n" + _log_tail(tmp, log_path))
        return results


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue


def _log_tail(tmp: Path, log_path: Path, chars: int = 4000) -> str:
    texts = [log_path.read_text(errors="replace")[-chars:]]
    for f in sorted((tmp / "logs").rglob("*.log")) if (tmp / "logs").exists() else []:
        texts.append(f"[{f.parent.name}/{f.name}]\n" + f.read_text(errors="replace")[-chars:])
    return "\n".join(texts)
