"""The pieces of issue 17 that need no launch: the run-directory lock, checkpoint selection on
resume, metrics.jsonl after a kill, and the one-line failure report (tests/test_faults.py runs
them all for real)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megadiv.config import ConfigError, ParallelConfig
from megadiv.models.checkpoint import CheckpointError
from megadiv.trainer.checkpoint import CHECKSUM, FORMAT, MANIFEST, file_checksum, layout_of, resume_point
from megadiv.trainer.lifecycle import DiskError, RunGuard, RunLock, RunLocked, writing
from megadiv.trainer.loggers import read_records, truncate_records

TP1 = ParallelConfig()


def fake_checkpoint(root: Path, step: int, files: dict[str, bytes], parallel=TP1, manifest=True) -> Path:
    path = root / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    if manifest:
        (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "layout": layout_of(parallel),
                                                 "world_size": 1,
                                                 "files": {k: len(v) for k, v in files.items()},
                                                 CHECKSUM: {k: file_checksum(path / k) for k in files}}))
    return path


def test_lock_keeps_a_second_run_out_until_the_first_releases(tmp_path):
    first, second = RunLock(tmp_path / "run"), RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(RunLocked, match=r"is in use by pid \d+ on .*\.lock"):
        second.acquire()
    with pytest.raises(RunLocked):
        second.check_free()
    first.release()
    second.check_free()
    second.acquire()
    second.release()


def test_resume_takes_the_newest_complete_checkpoint_and_names_the_skipped(tmp_path):
    assert resume_point(tmp_path, TP1) == (None, [])  # nothing yet: a fresh start
    good = fake_checkpoint(tmp_path, 1, {"a.distcp": b"x" * 10, "common.pt": b"y" * 3})
    truncated = fake_checkpoint(tmp_path, 2, {"a.distcp": b"x" * 10})
    (truncated / "a.distcp").write_bytes(b"x" * 4)
    missing = fake_checkpoint(tmp_path, 3, {"rng_0.pt": b"r"})
    (missing / "rng_0.pt").unlink()
    unsealed = fake_checkpoint(tmp_path, 4, {"a.distcp": b"x"}, manifest=False)
    (tmp_path / "checkpoints" / "step_000005.partial").mkdir()
    path, skipped = resume_point(tmp_path, TP1)
    assert path == good
    assert skipped == [f"skipping checkpoint {unsealed}: no manifest.json (the save did not finish, or an older "
                       f"megadiv wrote it)",
                       f"skipping checkpoint {missing}: rng_0.pt is missing",
                       f"skipping checkpoint {truncated}: a.distcp is 4 bytes, the manifest says 10 (truncated or "
                       f"overwritten)"]
    # the TP and data-parallel sizes may change (a DP=2 checkpoint resumes at DP=1 and at TP=2:
    # tests/test_trainer.py), the pipeline split may not
    assert resume_point(tmp_path, ParallelConfig(tensor_parallel=2))[0] == good
    with pytest.raises(ConfigError, match=r"written with parallel.pipeline_parallel=1 \(now 2\)"):
        resume_point(tmp_path, ParallelConfig(pipeline_parallel=2))
    # a checkpoint of the format before (its rollout state in megatron's common state) is refused in one line
    manifest = json.loads((good / MANIFEST).read_text())
    (good / MANIFEST).write_text(json.dumps({k: v for k, v in manifest.items() if k != "format"}))
    with pytest.raises(ConfigError, match=r"is a checkpoint of format 1 \(the rollout state in megatron's common.pt\); "
                                          r"this megadiv resumes format 2") as refused:
        resume_point(tmp_path, TP1)
    assert "\n" not in str(refused.value)
    (good / MANIFEST).write_text(json.dumps(manifest))
    # checkpoints, but none complete: an error, never a silent restart from step 0
    (good / "common.pt").unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint in .*common.pt is missing"):
        resume_point(tmp_path, TP1)


def test_metrics_after_a_kill_mid_write_and_a_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 3)) + '{"step": 4, "x"')
    assert [r["step"] for r in read_records(path)] == [0, 1, 2, 3]  # the torn line is skipped
    truncate_records(path, 2)  # resumed from the checkpoint of step 2
    assert [r["step"] for r in read_records(path)] == [0, 1, 2] and path.read_text().endswith("\n")
    truncate_records(path, -1)  # a fresh start
    assert path.read_text() == ""


def test_a_failure_report_is_one_line_naming_rank_step_and_file(tmp_path):
    guard = RunGuard(tmp_path / "run", rank=1)
    guard.step = 7
    try:
        raise ValueError("/data/x.jsonl:3: not valid JSON\n(details)")
    except ValueError as e:
        line = guard._report(e)
    log = tmp_path / "run" / "logs" / "rank1.log"
    assert "\n" not in line
    assert line.startswith("megadiv train: rank 1 failed at step 7: ValueError: /data/x.jsonl:3: not valid JSON "
                           "(details) (raised at ")
    assert line.endswith(f"; traceback in {log}")
    assert "Traceback (most recent call last)" in log.read_text() and "step 7" in log.read_text()


def test_a_same_size_corruption_is_caught_by_the_checksum(tmp_path):
    good = fake_checkpoint(tmp_path, 1, {"a.distcp": bytes(range(256)) * 64})
    corrupt = fake_checkpoint(tmp_path, 2, {"a.distcp": bytes(range(256)) * 64, "common.pt": b"c"})
    data = bytearray((corrupt / "a.distcp").read_bytes())
    data[8000:8004] = b"\xff\xff\xff\xff"  # same size, other bytes
    (corrupt / "a.distcp").write_bytes(bytes(data))
    path, skipped = resume_point(tmp_path, TP1)
    assert path == good
    actual = file_checksum(corrupt / "a.distcp")
    expected = json.loads((corrupt / MANIFEST).read_text())[CHECKSUM]["a.distcp"]
    assert skipped == [f"skipping checkpoint {corrupt}: a.distcp has xxh3_64 {actual}, the manifest says {expected} "
                       f"(corrupted on disk after the save: same size, other bytes)"]
    # an older manifest without checksums is checked by size alone
    manifest = json.loads((corrupt / MANIFEST).read_text())
    del manifest[CHECKSUM]
    (corrupt / MANIFEST).write_text(json.dumps(manifest))
    assert resume_point(tmp_path, TP1) == (corrupt, [])


def test_a_failed_write_is_one_line_naming_the_path_and_the_free_space(tmp_path):
    target = tmp_path / "no-such-dir" / "metrics.jsonl"
    with pytest.raises(DiskError) as caught:
        with writing(target, "metrics"):
            target.open("a")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"cannot write metrics {target}: No such file or directory; ")
    assert message.endswith(f"free of {message.split(' free of ')[1].split(' on ')[0]} on the file system of {tmp_path}")
    line = RunGuard(tmp_path / "run", rank=0)._report(caught.value)
    assert "raised at" not in line and message in line  # the path is the place, not the helper that raised
    # errors that wrap a failed write (megatron's writers, torch.save) are disk errors; others pass
    with pytest.raises(DiskError, match=r"cannot write checkpoint .*: \[Errno 28\] No space left on device; .* free"):
        with writing(target, "checkpoint", wrapping=(RuntimeError,)):
            raise RuntimeError("Worker failure: [Errno 28] No space left on device")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        with writing(target, "checkpoint", wrapping=(RuntimeError,)):
            raise RuntimeError("[gloo] Connection closed by peer")
