"""The pieces of issue 17 that need no launch: the run-directory lock, checkpoint selection on
resume, metrics.jsonl after a kill, and the one-line failure report (tests/test_faults.py runs
them all for real)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megadiv.config import ConfigError, ParallelConfig
from megadiv.models.checkpoint import CheckpointError
from megadiv.trainer.checkpoint import MANIFEST, layout_of, resume_point
from megadiv.trainer.lifecycle import RunGuard, RunLock, RunLocked
from megadiv.trainer.loggers import read_records, truncate_records

TP1 = ParallelConfig()


def fake_checkpoint(root: Path, step: int, files: dict[str, bytes], parallel=TP1, manifest=True) -> Path:
    path = root / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    if manifest:
        (path / MANIFEST).write_text(json.dumps({"step": step, "layout": layout_of(parallel), "world_size": 1,
                                                 "files": {k: len(v) for k, v in files.items()}}))
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
