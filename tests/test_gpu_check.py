"""tools/gpu_check.sh, the prepared GPU verification run, on a CPU: every GPU item skipped with
its reason, argument handling, the report's schema, robustness (a failing or hanging item never
stops the others or the report), the wheel step, and the timing helper's statistics. The items'
own code runs on a CPU at toy shapes in the ``slow`` smoke test."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.timing import summary, time_region

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu_check.sh"
_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)   # a script, not a package
_spec.loader.exec_module(gpu_check)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the items really run")
ITEM_KEYS = {"status", "reason", "figures", "samples", "wall_s", "budget_s"}


def run_script(*args, timeout=180):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@needs_no_cuda
def test_cpu_run_reports_every_gpu_item_skipped_with_its_reason(tmp_path):
    out = tmp_path / "out"
    proc = run_script(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["schema"] == gpu_check.SCHEMA and report["smoke"] is False
    assert report["budget_s"] == gpu_check.DEFAULT_BUDGET_S and 0 <= report["wall_s"] < report["budget_s"]
    assert report["environment"]["cuda_available"] is False and report["environment"]["torch"] == torch.__version__
    assert list(report["items"]) == [item.name for item in gpu_check.ITEMS]
    for name, item in report["items"].items():
        assert set(item) == ITEM_KEYS, name
        assert item["status"] == "skipped", (name, item)
        assert item["figures"] == {} and item["samples"] == {}
        assert item["reason"], name
    reasons = {name: item["reason"] for name, item in report["items"].items()}
    assert reasons["gpu_tests"] == reasons["divergence_bench"] == gpu_check.NO_CUDA
    # not importable here: Transformer Engine is reported as not carried, whatever the device
    assert reasons["transformer_engine"].startswith("not carried: Transformer Engine")
    assert report["wheels"]["status"] == "skipped" and report["wheels"]["reason"]
    assert (out / "gpu_check.log").exists()
    assert "[gpu_check] report:" in proc.stdout


def test_item_budgets_fit_the_run():
    """The device call is planned around 480 s: the items' budgets and the install fit in it."""
    total = sum(item.budget_s for item in gpu_check.ITEMS) + gpu_check.INSTALL_BUDGET_S
    assert total + 5 <= gpu_check.DEFAULT_BUDGET_S == 480, total
    assert [i.name for i in gpu_check.ITEMS] == list(gpu_check.RUNNERS)


def test_arguments_are_checked_before_anything_runs(tmp_path, capsys):
    proc = run_script(timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: bash tools/gpu_check.sh OUT_DIR")
    proc = run_script("--smoke", timeout=60)          # an option where OUT_DIR belongs
    assert proc.returncode == 2 and "usage:" in proc.stderr
    for args, message in [(["--only", "gpu_tests,mfu"], "unknown item(s) mfu"), (["--budget", "0"], "--budget must be > 0")]:
        with pytest.raises(SystemExit) as exc:
            gpu_check.main([str(tmp_path / "x"), *args])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@needs_no_cuda
def test_only_runs_the_named_items(tmp_path):
    assert gpu_check.main([str(tmp_path), "--only", "no_host_sync, gpu_tests"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["items"]) == ["gpu_tests", "no_host_sync"]   # in the run's order


def test_a_failing_and_a_hanging_item_leave_the_others_and_the_report(tmp_path, monkeypatch, capsys):
    # transformer_engine without TE raises ModuleNotFoundError in its child; gpu_tests cannot even
    # start pytest in 1 s; gpt_step_mfu is skipped (a stand-in package is missing); no_host_sync
    # still runs in what is left of the budget (and fails without CUDA), or is skipped for time.
    monkeypatch.setattr(gpu_check, "ITEMS", [
        gpu_check.Item("transformer_engine", 60, ()), gpu_check.Item("gpu_tests", 1, ()),
        gpu_check.Item("gpt_step_mfu", 20, ("megatron_missing",)), gpu_check.Item("no_host_sync", 1000, ())])
    monkeypatch.setitem(gpu_check.NOT_CARRIED, "megatron_missing", "not carried: stand-in")
    assert gpu_check.run_all(tmp_path, None, budget_s=120, smoke=False) == 1
    items = json.loads((tmp_path / "gpu_check.json").read_text())["items"]
    assert items["transformer_engine"]["status"] == "failed"
    assert "exited with 1" in items["transformer_engine"]["reason"]
    assert "transformer_engine" in items["transformer_engine"]["log_tail"]        # the traceback
    assert items["gpu_tests"]["status"] == "failed" and items["gpu_tests"]["reason"] == "timed out after 1 s (its budget)"
    assert items["gpt_step_mfu"] == {"status": "skipped", "reason": "not carried: stand-in", "figures": {},
                                     "samples": {}, "wall_s": items["gpt_step_mfu"]["wall_s"], "budget_s": 20}
    assert items["no_host_sync"]["status"] in ("failed", "skipped")   # ran in what was left, or no time left
    assert items["no_host_sync"]["budget_s"] == 1000
    assert "[gpu_check] report:" in capsys.readouterr().out


def test_carried_wheels_install_only_on_a_cuda_machine(tmp_path):
    assert gpu_check.install_wheels(tmp_path, cuda=True, budget_s=60)["status"] == "skipped"   # none carried
    (tmp_path / "not_a-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    off = gpu_check.install_wheels(tmp_path, cuda=False, budget_s=60)
    assert off["status"] == "skipped" and "for the GPU machine" in off["reason"]
    broken = gpu_check.install_wheels(tmp_path, cuda=True, budget_s=120)
    assert broken["status"] == "failed" and broken["reason"].startswith("pip install exited with")


def test_no_host_sync_checks_run_and_give_gradients_on_cpu():
    """The passes the no_host_sync item watches on a GPU, here on a CPU (the sync watcher is
    CUDA-only): each runs and fills a finite, non-zero gradient of the logits."""
    checks = gpu_check.sync_checks(torch.device("cpu"), seqs=2, length=8, vocab=64)
    assert len(checks) == 5
    for name, run in checks.items():
        z = run()
        assert z.grad is not None and torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0, name


def test_timing_helper_statistics_and_protocol():
    assert summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summary([4.0, 1.0, 2.0, 10.0])["median"] == 3.0          # even count: mean of the middle two
    with pytest.raises(ValueError):
        summary([])
    calls, setups = [], []

    def setup():
        setups.append(len(setups))
        return setups[-1]

    samples = time_region(calls.append, warmup=2, repeats=3, device=torch.device("cpu"), setup=setup)
    assert len(samples) == 3 and all(s >= 0 for s in samples)
    assert calls == [0, 1, 2, 3, 4]            # 2 warm-up calls, then 3 timed, each with a fresh setup()
    counter = []
    assert len(time_region(lambda: counter.append(1), warmup=0, repeats=4, device=torch.device("cpu"))) == 4
    assert len(counter) == 4
    with pytest.raises(ValueError):
        time_region(lambda: None, warmup=0, repeats=0, device=torch.device("cpu"))


@pytest.mark.slow
@needs_no_cuda
def test_smoke_runs_the_items_code_on_cpu(tmp_path):
    """The items' code at toy shapes: the benchmark, megatron step and pytest runs produce figures."""
    proc = run_script(tmp_path, "--smoke", "--only", "divergence_bench,gpt_step_mfu", timeout=900)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 0, proc.stdout + json.dumps(report, indent=1)[-4000:]
    bench, step = report["items"]["divergence_bench"], report["items"]["gpt_step_mfu"]
    assert bench["status"] == step["status"] == "passed"
    rows = bench["figures"]["rows"]
    assert len(rows) == 7 and rows["(a) megatron vocab_parallel_cross_entropy"]["time_x_megatron_ce"] == 1.0
    assert all(len(s) == 2 for s in bench["samples"].values())
    assert step["figures"]["parameters"] > 0 and step["figures"]["tokens_per_step"] == 32
    assert len(step["samples"]["step_s"]) == 3 and step["figures"]["mfu"] > 0
