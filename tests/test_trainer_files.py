"""Bring your own data and dashboards, end to end (real ``megadiv train`` runs of the shrunk demo on
one CPU rank): a verl GSM8K-layout Parquet file (chat-message prompts, the gold answer in
reward_model.ground_truth) trains as it is, with TensorBoard and W&B (offline) on, stopped after
step 1 and resumed: the resumed launch continues the same W&B run, and the exported model's card
lists that run's figures. A flat Parquet file, a JSON file and a save_to_disk directory each
train two steps."""
from __future__ import annotations

import json

import pytest

from megadiv.data import DataConfig, load_dataset
from tests.test_data_files import verl_rows, write_parquet
from tests.test_loggers import wandb_runs
from tests.test_trainer import megadiv_train, step_records

pytestmark = pytest.mark.slow

# One rank, 4 prompts x 4 samples, 5 warm-start steps, no evaluation between steps, 4 held-out
# problems; DAPO's overlong shaping gives the groups reward differences (tests/test_faults.py).
ONE_RANK = ["parallel.tensor_parallel=1", "grpo.overlong_buffer=3", "eval.every=0", "eval.samples=0",
            "eval.data.max_items=4", "grpo.steps=2"]


def arithmetic_problems(n: int = 16) -> list[tuple[str, str]]:
    return [(r.prompt, r.answer) for r in load_dataset(DataConfig(name="arithmetic", split="train", max_items=n))]


def test_verl_parquet_trains_as_it_is_with_tensorboard_wandb_and_a_model_card(tmp_path, monkeypatch):
    from huggingface_hub import ModelCard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    problems = arithmetic_problems()
    train = write_parquet(tmp_path / "train.parquet", verl_rows(problems))
    test = write_parquet(tmp_path / "test.parquet", verl_rows(problems[:4], split="test"))
    verl = "answer_field: reward_model.ground_truth, template: auto"
    run_dir = tmp_path / "verl"
    args = [*ONE_RANK, "data.name=hf", f"data.path={train}", "data.answer_field=reward_model.ground_truth",
            "data.template=auto", f"eval.data={{name: hf, path: {test}, {verl}, shuffle: false}}",
            "eval.samples=2", "warm_start.tokenizer=bpe", "model.max_position_embeddings=256", "reward.name=math",
            "reward.workers=1",
            "run.loggers=[jsonl, tensorboard, wandb]", "run.wandb_project=byo", "run.wandb_tags=[verl, test]"]
    out = megadiv_train(run_dir, *args, "grpo.stop_after=1", nproc=1)
    assert "stopped after step 1" in out
    out = megadiv_train(run_dir, *args, nproc=1)
    assert "resumed from" in out

    steps = step_records(run_dir)
    # step 1 trains; a later step may draw every group at one reward (all 16 responses cut at 4
    # tokens: overlong shaping gives each -1), which GRPO turns into zero advantages and gradient
    assert [r["step"] for r in steps] == [1, 2] and steps[0]["grad_norm"] > 0
    assert all(r["grad_norm"] >= 0 and r["skipped"] == 0 for r in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    first, second = wandb_runs(run_dir)  # offline run files under the run directory, one run id
    assert first["id"] == second["id"] == (run_dir / "wandb" / "megadiv_run_id").read_text().strip()
    assert (first["name"], first["project"], first["tags"]) == ("verl", "byo", ["verl", "test"])
    assert first["config"]["data"]["path"] == str(train) and first["config"]["grpo"]["steps"] == 2
    assert [s["_step"] for s in first["steps"]] == [0, 1] and [s["_step"] for s in second["steps"]] == [2]
    assert first["steps"][1]["reward/mean"] == steps[0]["reward/mean"]
    assert second["summary"]["accuracy_after"] == summary["accuracy_after"]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2]

    card = ModelCard.load(run_dir / "hf" / "README.md")  # parsed by the Hub's own client
    assert card.data.library_name == "transformers" and "megadiv" in card.data.tags
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == summary["eval_after"]
    for key, after in summary["eval_after"].items():
        assert f"| {key} | {summary['eval_before'][key]:.4f} | {after:.4f} |" in card.text
    assert "train.parquet (hf; prompt_field prompt, answer_field reward_model.ground_truth)" in card.text


@pytest.mark.parametrize("kind", ["parquet", "json", "save_to_disk"])
def test_flat_files_train_two_steps(tmp_path, kind):
    import datasets

    rows = [{"question": q, "final": a, "uid": f"p-{i}"} for i, (q, a) in enumerate(arithmetic_problems())]
    path = {"parquet": tmp_path / "train.parquet", "json": tmp_path / "train.json", "save_to_disk": tmp_path / "saved"}[kind]
    if kind == "parquet":
        write_parquet(path, rows)
    elif kind == "json":
        path.write_text(json.dumps(rows))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    run_dir = tmp_path / "run"
    megadiv_train(run_dir, *ONE_RANK, "data.name=hf", f"data.path={path}", "data.prompt_field=question",
                  "data.answer_field=final", "data.id_field=uid", "data.expected_rows=16", nproc=1)
    steps = step_records(run_dir)
    # step 1 trains; a later step may draw every group at one reward (all 16 responses cut at 4
    # tokens: overlong shaping gives each -1), which GRPO turns into zero advantages and gradient
    assert [r["step"] for r in steps] == [1, 2] and steps[0]["grad_norm"] > 0
    assert all(r["grad_norm"] >= 0 and r["skipped"] == 0 for r in steps)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
