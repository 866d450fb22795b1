"""run.loggers without a launch: metrics.jsonl always, TensorBoard, and a real W&B run in offline
mode (files under the run directory, the config and summary in it, a resume continuing its id);
unknown names and stray wandb_* keys refused; a missing wandb package named. The W&B run files
are read back here with a reader of their record format (LevelDB's log: 32 KiB blocks of
checksum, length, type, data) and wandb's own protobuf messages. tests/test_trainer_files.py
checks the same on real runs."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from megadiv.config import ConfigError, RunConfig, load_config
from megadiv.trainer.loggers import LOGGERS, import_wandb
from megadiv.trainer.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[1]


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (run-<id>.wandb): a 7-byte header (':W&B', magic,
    version), then 32 KiB blocks of chunks [crc32 4, length 2, type 1, data]; a record is one FULL
    chunk (type 1) or FIRST (2), MIDDLE (3)..., LAST (4); a block's tail under 7 bytes is padding."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero fill up to the block's end
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline W&B run directory under run_dir/wandb, oldest first: its id, the run record's
    name, project, tags and config, the history's steps, the last summary values, the exit code."""
    runs = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = d.glob("run-*.wandb")
        out = {"id": path.stem.removeprefix("run-"), "steps": [], "summary": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out |= {"run_id": record.run.run_id, "name": record.run.display_name, "project": record.run.project,
                        "tags": list(record.run.tags),
                        "config": _items(record.run.config.update)}
            elif kind == "history":
                out["steps"].append(_items(record.history.item))
            elif kind == "summary":
                out["summary"] |= _items(record.summary.update)
            elif kind == "exit":
                out["exit_code"] = record.exit.exit_code
        runs.append(out)
    return runs


def _items(items) -> dict:
    """key -> value of W&B's items (a key is ``key``, or ``nested_key`` joined by '/')."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_every_logger_gets_each_record_and_a_resume_continues_the_wandb_run(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    run = RunConfig(name="mine", loggers=("tensorboard", "wandb"), wandb_project="proj", wandb_tags=("a", "b"))
    config = {"grpo": {"steps": 3}, "run": {"name": "mine"}}
    logger = MetricsLogger(tmp_path, True, 3, run, config)
    assert [type(b).__name__ for b in logger.backends] == ["JsonlLogger", "TensorBoardLogger", "WandbLogger"]
    logger.log(0, {"eval/accuracy": 0.25}, prefix="eval")
    logger.log(1, {"reward/mean": 0.5, "loss/total": float("nan")})
    logger.log(2, {"reward/mean": 0.75})  # dropped from metrics.jsonl and TensorBoard by the resume below
    logger.close()
    first_id = (tmp_path / "wandb" / "megadiv_run_id").read_text().strip()
    # W&B names a run's directory offline-run-<start second>-<id>: a resume of the same id within the
    # same second would land in the first launch's directory (launches are minutes apart, not here)
    time.sleep(1.1)

    resumed = MetricsLogger(tmp_path, True, 3, run, config, resumed_step=1)
    resumed.log(2, {"reward/mean": 0.8})
    resumed.log(3, {"reward/mean": 0.9})
    resumed.write_summary({"accuracy_before": 0.25, "accuracy_after": 0.5, "steps": 3})
    resumed.close()
    resumed.close()  # idempotent: the loop closes on every way out
    import wandb

    wandb.teardown()  # the W&B service of this process writes the run files out (a run's process ends here)

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("reward/mean")) for r in records] == [(0, None), (1, 0.5), (2, 0.8), (3, 0.9)]
    assert records[1]["loss/total"] == "nan"
    assert json.loads((tmp_path / "summary.json").read_text())["accuracy_after"] == 0.5
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.5), (2, pytest.approx(0.8)),
                                                                           (3, pytest.approx(0.9))]
    first, second = wandb_runs(tmp_path)  # (both start with the run record; sorted by start time)
    assert first["id"] == second["id"] == first["run_id"] == first_id  # one W&B run, continued
    assert (first["name"], first["project"], first["tags"]) == ("mine", "proj", ["a", "b"])
    assert first["config"]["grpo"] == {"steps": 3}
    assert [s["_step"] for s in first["steps"]] == [0, 1, 2] and [s["_step"] for s in second["steps"]] == [2, 3]
    assert second["summary"]["accuracy_after"] == 0.5 and second["summary"]["steps"] == 3

    fresh = MetricsLogger(tmp_path, True, 3, run, config)  # a fresh start in the same directory: a new run
    fresh.close(failed=True)  # as when the run stops on an error
    wandb.teardown()
    third_id = (tmp_path / "wandb" / "megadiv_run_id").read_text().strip()
    (third,) = [r for r in wandb_runs(tmp_path) if r["id"] == third_id]
    assert third_id != first_id
    assert (first["exit_code"], second["exit_code"], third["exit_code"]) == (0, 0, 1)


def test_other_ranks_log_nothing(tmp_path):
    logger = MetricsLogger(tmp_path, False, 3, RunConfig(loggers=("tensorboard", "wandb")), {})
    logger.log(1, {"reward/mean": 0.5})
    logger.write_summary({"steps": 1})
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_logger_names_and_keys_are_checked_with_the_config(tmp_path, monkeypatch):
    import typing

    from megadiv.config import LoggerName
    from megadiv.trainer.config import TrainConfig

    assert set(LOGGERS) == set(typing.get_args(LoggerName))
    base = [f"model.hf_dir={tmp_path}/init"]
    with pytest.raises(ConfigError, match=r"run.loggers\[1\]: 'mlflow' is not one of \['jsonl', 'tensorboard', "
                                          r"'wandb'\]"):
        load_config(TrainConfig, REPO / "examples" / "tiny" / "grpo.yaml", [*base, "run.loggers=[jsonl, mlflow]"])
    with pytest.raises(ConfigError, match="run.wandb_tags applies when run.loggers includes wandb"):
        load_config(TrainConfig, REPO / "examples" / "tiny" / "grpo.yaml", [*base, "run.wandb_tags=[x]"])
    with pytest.raises(ConfigError, match="lists a logger twice"):
        RunConfig(loggers=("wandb", "wandb"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"run.loggers includes wandb, but the wandb package is not installed"):
        import_wandb()


def test_check_config_refuses_wandb_when_it_is_not_installed(tmp_path, capsys, monkeypatch):
    from megadiv.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    args = ["check-config", str(REPO / "examples" / "tiny" / "grpo.yaml"), f"run.output_dir={tmp_path}",
            f"model.hf_dir={tmp_path}/init", "run.loggers=[jsonl, wandb]"]
    assert main(args) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert line.startswith("megadiv: invalid config: run.loggers includes wandb, but the wandb package is not installed")
