"""tools/gpu_check.sh, the prepared GPU verification run, on a CPU: every GPU item skipped with
its reason, argument handling, the report's schema, robustness (a failing or hanging item never
stops the others or the report), the wheel step, and the timing helper's statistics. The items'
own code runs on a CPU at toy shapes in the ``slow`` smoke test."""
import importlib.util
import json
import os
import subprocess
import sys
import time
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
    # what the GPU machine cannot reach, and why: the fixed list, then every item skipped here
    unverified = report["unverified"]
    assert all(set(u) == {"feature", "why"} and u["feature"] and u["why"] for u in unverified)
    assert [(u["feature"], u["why"]) for u in unverified[:len(gpu_check.UNVERIFIED)]] == gpu_check.UNVERIFIED
    assert {u["feature"] for u in unverified[len(gpu_check.UNVERIFIED):]} == {f"item {i.name}" for i in gpu_check.ITEMS}
    features = " ".join(u["feature"] for u in unverified)
    for path in ("Transformer Engine", "FP8", "SGLang server on a GPU", "CUDA-IPC", "NCCL", "apex"):
        assert path in features, path


def test_item_budgets_fit_the_run():
    """The device call runs at most 600 s: the run's 540 s hold the items' budgets, the install,
    compileall and 5 s for the report; the gpu test modules' budgets fit in gpu_tests', and every
    module that holds a gpu-marked test has one of its own."""
    total = sum(item.budget_s for item in gpu_check.ITEMS) + gpu_check.INSTALL_BUDGET_S + gpu_check.PRECOMPILE_BUDGET_S
    assert total + 5 <= gpu_check.DEFAULT_BUDGET_S == 540, total
    assert [i.name for i in gpu_check.ITEMS] == list(gpu_check.RUNNERS)
    modules = gpu_check.gpu_test_modules()
    assert "tests/test_policy_gpu.py" in modules and "tests/test_gpu_check.py" not in modules
    assert sorted(gpu_check.GPU_TEST_BUDGETS) == modules
    gpu_tests = next(i for i in gpu_check.ITEMS if i.name == "gpu_tests")
    assert sum(gpu_check.GPU_TEST_BUDGETS.values()) <= gpu_tests.budget_s


HANGING_MODULE = """
import time
import pytest
pytestmark = pytest.mark.gpu
def test_passes():
    pass
def test_skips():
    pytest.skip("no such device here")
def test_fails():
    assert 1 == 2
def test_hangs():
    time.sleep(600)
def test_never_reached():
    pass
"""


def test_a_test_module_cut_at_its_budget_reports_the_tests_that_finished(tmp_path, monkeypatch):
    """gpu_tests runs each module under its own budget: a module that hangs is cut and still
    reports what finished before (outcomes written per test by tools/pytest_outcomes.py), a
    module with no time left is listed as not run, and the counts so far are in partial.json for
    the orchestrator."""
    hanging, later = tmp_path / "test_hanging.py", tmp_path / "test_later.py"
    hanging.write_text(HANGING_MODULE)
    later.write_text("def test_x():\n    pass\n")
    monkeypatch.setattr(gpu_check, "gpu_test_modules", lambda: [str(hanging), str(later)])
    monkeypatch.setattr(gpu_check, "GPU_TEST_BUDGETS", {str(hanging): 25, str(later): 25})
    work = tmp_path / "work"
    work.mkdir()
    # 26 s: the hanging module is cut at 26 - 2 = 24 s, which leaves the next one < 3 s: not run
    out = gpu_check.item_gpu_tests(work, smoke=False, deadline=time.time() + 26)
    modules = out["figures"]["modules"]
    cut = modules[str(hanging)]
    assert cut["cut"] is True and cut["exit_code"] < 0          # killed
    assert (cut["passed"], cut["failed"], cut["skipped"], cut["errors"]) == (1, 1, 1, 0)
    assert cut["skip_reasons"] == {"no such device here": 1}
    # (the node id's directory part is pytest's rootdir's business: where the checkout and tmp_path lie)
    assert len(cut["failures"]) == 1 and f"{hanging.name}::test_fails (call): " in cut["failures"][0]
    assert "assert 1 == 2" in cut["failures"][0]
    assert modules[str(later)] == {"status": "not run: no time left in the item's budget", "budget_s": 25}
    assert out["status"] == "failed"
    assert out["reason"] == f"1 failed, 0 errors; cut at their budget or not run: {hanging}, {later}"
    assert (out["figures"]["passed"], out["figures"]["failed"], out["figures"]["skipped"]) == (1, 1, 1)
    partial = json.loads((work / "partial.json").read_text())
    assert partial["figures"]["modules"][str(hanging)] == cut


def test_an_item_cut_or_crashed_reports_its_partial_results(tmp_path):
    """What the orchestrator reports for an item from its exit code and work folder."""
    assert gpu_check.item_outcome(124, 30, tmp_path) == {"status": "failed", "reason": "timed out after 30 s (its budget)"}
    gpu_check.write_partial(tmp_path, {"figures": {"bytes": 5}, "samples": {"s": [1.0]}})
    assert gpu_check.item_outcome(124, 30, tmp_path) == {
        "status": "failed", "reason": "timed out after 30 s (its budget)", "figures": {"bytes": 5},
        "samples": {"s": [1.0]}, "partial": True}
    assert gpu_check.item_outcome(1, 30, tmp_path)["partial"] is True            # an exception after it
    (tmp_path / "result.json").write_text(json.dumps({"figures": {"bytes": 9}}))
    assert gpu_check.item_outcome(0, 30, tmp_path) == {"status": "passed", "figures": {"bytes": 9}}


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
    # transformer_engine without TE raises ModuleNotFoundError in its child; padding_invariance
    # cannot even import megatron in 1 s; gpt_step_mfu is skipped (a stand-in package is missing); no_host_sync
    # still runs in what is left of the budget (and fails without CUDA), or is skipped for time.
    monkeypatch.setattr(gpu_check, "ITEMS", [
        gpu_check.Item("transformer_engine", 60, ()), gpu_check.Item("padding_invariance", 1, ()),
        gpu_check.Item("gpt_step_mfu", 20, ("megatron_missing",)), gpu_check.Item("no_host_sync", 1000, ())])
    monkeypatch.setitem(gpu_check.NOT_CARRIED, "megatron_missing", "not carried: stand-in")
    assert gpu_check.run_all(tmp_path, None, budget_s=120, smoke=False) == 1
    items = json.loads((tmp_path / "gpu_check.json").read_text())["items"]
    assert items["transformer_engine"]["status"] == "failed"
    assert "exited with 1" in items["transformer_engine"]["reason"]
    assert "transformer_engine" in items["transformer_engine"]["log_tail"]        # the traceback
    cut = items["padding_invariance"]
    assert cut["status"] == "failed" and cut["reason"] == "timed out after 1 s (its budget)" and "partial" not in cut
    assert items["gpt_step_mfu"] == {"status": "skipped", "reason": "not carried: stand-in", "figures": {},
                                     "samples": {}, "wall_s": items["gpt_step_mfu"]["wall_s"], "budget_s": 20}
    assert items["no_host_sync"]["status"] in ("failed", "skipped")   # ran in what was left, or no time left
    assert items["no_host_sync"]["budget_s"] == 1000
    assert "[gpu_check] report:" in capsys.readouterr().out


@needs_no_cuda
def test_a_run_with_a_tiny_budget_reports_the_cut_items_partial_counts(tmp_path, monkeypatch):
    """The real gpu_tests item (every gpu test skips here) with 8 s for six test modules: it is
    cut, and the report still lists each module with its counts, or as cut or not run."""
    monkeypatch.setattr(gpu_check, "ITEMS", [gpu_check.Item("gpu_tests", 8, ())])
    assert gpu_check.run_all(tmp_path, None, budget_s=120, smoke=False) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    item = report["items"]["gpu_tests"]
    assert item["status"] == "failed" and "cut at their budget or not run" in item["reason"], item
    modules = item["figures"]["modules"]
    assert list(modules) == gpu_check.gpu_test_modules()
    assert any(m.get("cut") or m.get("status", "").startswith("not run") for m in modules.values())
    for m in modules.values():
        assert m.get("status", "").startswith("not run") or {"passed", "skipped", "cut", "wall_s"} <= set(m), m
    assert item["figures"]["passed"] == item["figures"]["failed"] == 0
    assert report["precompile"]["status"] == "passed"


def test_carried_wheels_install_only_on_a_cuda_machine(tmp_path):
    assert gpu_check.install_wheels(tmp_path, cuda=True, budget_s=60)["status"] == "skipped"   # none carried
    (tmp_path / "not_a-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    off = gpu_check.install_wheels(tmp_path, cuda=False, budget_s=60)
    assert off["status"] == "skipped" and "for the GPU machine" in off["reason"]
    broken = gpu_check.install_wheels(tmp_path, cuda=True, budget_s=120)
    assert broken["status"] == "failed" and broken["reason"].startswith("pip install exited with")


class FakeSyncWatcher:
    """torch's sync-debug mode as the no_host_sync item queries it, on a CPU: in 'error' mode a
    host synchronisation (here: Tensor.item) raises the RuntimeError CUDA raises. ``catches=False``:
    a watcher that is never on."""

    def __init__(self, monkeypatch, catches: bool = True):
        self.mode, self.catches = 0, catches
        item = torch.Tensor.item

        def watched_item(tensor):
            if self.mode == "error" and self.catches:
                raise RuntimeError("called a synchronizing CUDA operation\n(traceback)")
            return item(tensor)

        monkeypatch.setattr(torch.Tensor, "item", watched_item)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: setattr(self, "mode", mode))


def test_no_host_sync_judges_the_control_and_the_checks(monkeypatch):
    """The item's pass/fail logic on a CPU with a faked sync watcher: the planted .item() raising
    is the control passing (it once stored `not <error text>`, False, and failed on every GPU); a
    watcher that catches nothing fails the control; a check that synchronises fails by name."""
    FakeSyncWatcher(monkeypatch)
    ok = gpu_check.no_host_sync(torch.device("cpu"), 2, 8, 64)
    assert "status" not in ok, ok                     # passed
    assert ok["figures"]["verdict"] == "no host synchronisation"
    assert ok["figures"]["checks"][gpu_check.CONTROL] is True and len(ok["figures"]["checks"]) == 6
    assert all(v is True for v in ok["figures"]["checks"].values())

    checks = gpu_check.sync_checks
    monkeypatch.setattr(gpu_check, "sync_checks", lambda *a: checks(*a) | {"planted": lambda: torch.ones(2).sum().item()})
    bad = gpu_check.no_host_sync(torch.device("cpu"), 2, 8, 64)
    assert bad["status"] == "failed" and bad["reason"] == "planted: called a synchronizing CUDA operation"
    assert bad["figures"]["checks"][gpu_check.CONTROL] is True

    monkeypatch.setattr(gpu_check, "sync_checks", checks)
    FakeSyncWatcher(monkeypatch, catches=False)
    off = gpu_check.no_host_sync(torch.device("cpu"), 2, 8, 64)
    assert off["status"] == "failed" and off["reason"].startswith(f"{gpu_check.CONTROL}: not caught")
    assert off["figures"]["verdict"] == "host synchronisation found"


class _CudaTensorStandIn:
    """Pickles as serialize_bucket pickles a CUDA tensor: torch's rebuild_cuda_tensor with the GPU's
    UUID in the device argument."""

    def __init__(self, args):
        self.args = args

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor, self.args


def test_open_bucket_maps_the_uuid_in_a_payload_to_this_processs_device(monkeypatch):
    """weight_sync_rates' receiver opens serialize_bucket's payloads without sglang: the GPU's UUID
    in the device argument becomes this process's index of that GPU (faked device query here: two
    GPUs, the payload's the second), every other argument passed on as it came."""
    import base64
    import pickle

    import torch.multiprocessing.reductions as reductions

    from megadiv.rollout import weight_sync

    args = tuple(f"arg{i}" for i in range(weight_sync._DEVICE_ARG)) + ("GPU-bbbb", "handle", "offset")
    payload = base64.b64encode(pickle.dumps([("w", _CudaTensorStandIn(args))])).decode()
    opened = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: opened.append(a) or "tensor")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(weight_sync, "device_uuid", lambda i: ["GPU-aaaa", "GPU-bbbb"][i])
    assert gpu_check.open_bucket(payload) == [("w", "tensor")]
    assert opened == [args[:weight_sync._DEVICE_ARG] + (1, "handle", "offset")]
    assert reductions.rebuild_cuda_tensor.__name__ == "<lambda>"      # restored: the patch is scoped


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
def test_smoke_runs_every_items_code_on_cpu(tmp_path):
    """Every item's code at toy shapes, as tools/gpu_check.sh --smoke runs it: each one that can run
    on a CPU passes with its figures (no_host_sync's watcher and the two import checks need CUDA
    or packages a CPU run has not)."""
    proc = run_script(tmp_path, "--smoke", "--budget", "3000", timeout=3300)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 0, proc.stdout + json.dumps(report, indent=1)[-4000:]
    items = report["items"]
    assert list(items) == [i.name for i in gpu_check.ITEMS]
    assert {n for n, r in items.items() if r["status"] == "skipped"} == {
        "gpu_tests", "no_host_sync", "transformer_engine", "sglang_cuda"}
    assert all(r["status"] == "passed" and "partial" not in r for n, r in items.items()
               if n not in ("gpu_tests", "no_host_sync", "transformer_engine", "sglang_cuda")), items
    # gpu_tests: every gpu test skips here ("needs CUDA"), each module run and counted
    tests = items["gpu_tests"]
    assert list(tests["figures"]["modules"]) == gpu_check.gpu_test_modules()
    assert tests["figures"]["skipped"] > 0 and tests["figures"]["passed"] == tests["figures"]["failed"] == 0
    assert not any(m["cut"] for m in tests["figures"]["modules"].values())
    bench, step = items["divergence_bench"], items["gpt_step_mfu"]
    rows = bench["figures"]["rows"]
    assert len(rows) == 7 and rows["(a) megatron vocab_parallel_cross_entropy"]["time_x_megatron_ce"] == 1.0
    assert all(len(s) == 2 for s in bench["samples"].values())
    trainer_shapes = items["vocab_parallel_trainer"]["figures"]
    assert trainer_shapes["dtype"] == "float32" and len(trainer_shapes["rows"]) == 7
    assert step["figures"]["parameters"] > 0 and step["figures"]["tokens_per_step"] == 32
    assert len(step["samples"]["step_s"]) == 3 and step["figures"]["mfu"] > 0
    actor = items["actor_train_step"]["figures"]
    assert actor["parameters"] == step["figures"]["parameters"] and actor["tokens_per_step"] == 32
    assert actor["skipped_steps"] == 0 and actor["mfu"] > 0 and actor["tokens_per_s"] > 0
    assert len(items["actor_train_step"]["samples"]["step_s"]) == 2
    assert actor["planned_bytes"] == sum(actor["planned_components"].values()) > 0
    assert "peak_bytes" not in actor                   # the CUDA allocator's figure
    sync = items["weight_sync_rates"]["figures"]
    assert sync["bytes"] == 2 * actor["parameters"]    # every bf16 parameter exported once
    assert sync["buckets"] > 1 and sync["tensors"] > sync["buckets"]
    assert sync["export_gb_per_s"] > 0 and sync["handoff_gb_per_s"] > 0
    ckpt = items["async_checkpoint"]["figures"]
    assert ckpt["bit_exact"] is True and ckpt["tensors_differing"] == 0 and ckpt["trainer_state"] == {"step": 1}
    assert 0 < ckpt["tensors_the_step_changed"] <= ckpt["tensors_compared"]
    assert ckpt["checkpoint_bytes"] > 0 and ckpt["blocking_s"] > 0 and ckpt["total_s"] > 0
    probe = items["bf16_probe"]["figures"]
    for name in ("run_probe", "real_text", "random_tokens"):
        assert probe[name]["tokens"] > 0 and 0 < probe[name]["mean_abs"] <= probe[name]["max_abs"], name
    assert probe["trainer_dtype"] == "torch.bfloat16" and probe["run_limit"] >= probe["probe_floor"] == 0.05
    assert items["grpo_demo"]["figures"]["steps"] == 1
    deepspeed, padding = items["deepspeed_bf16"], items["padding_invariance"]
    for stage in ("zero0", "zero1", "zero3"):
        assert deepspeed["figures"][stage]["dtypes"] == ["torch.bfloat16"] and len(deepspeed["figures"][stage]["loss"]) == 3
    assert [deepspeed["figures"][s]["grad_accum_dtype"] for s in ("zero0", "zero1", "zero3")] == \
        ["torch.bfloat16", "torch.float32", "torch.float32"]
    assert deepspeed["figures"]["first_step_loss_zero3_minus_zero0"] == 0.0
    assert padding["figures"]["logp_max_abs_diff"] <= 1e-6 and padding["figures"]["multiple"] == 16


def test_gpu_wheels_gathers_every_wheel_deepspeed_included(tmp_path):
    """tools/gpu_wheels.sh as the device call's preparation runs it, into a folder named .whl as in
    the repository (the folder itself once counted as a wheel, so the script always failed). The
    downloads and the DeepSpeed build are cached in $MEGADIV_CACHE/gpu-wheels: seconds after the
    first run (which needs PyPI)."""
    dest = tmp_path / ".whl"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_wheels.sh"), "--dest", str(dest)], capture_output=True,
                          text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = sorted(p.name for p in dest.iterdir())
    assert len(wheels) == 12 and all(w.endswith(".whl") for w in wheels), wheels
    for name in ("megatron_core-0.16.1-cp312", "transformers-5.19.0-", "deepspeed-0.19.8-py3-none-any", "hjson-",
                 "pydantic-2.", "pydantic_core-", "annotated_types-", "typing_inspection-", "math_verify-0.9.0-"):
        assert any(w.startswith(name) for w in wheels), name
        assert name in proc.stdout                                       # listed
    total = sum((dest / w).stat().st_size for w in wheels)
    assert f"holds 12 wheels, {total} bytes" in proc.stdout and "of the 64 MiB a device call carries" in proc.stdout
    import zipfile

    deepspeed = zipfile.ZipFile(dest / next(w for w in wheels if w.startswith("deepspeed")))
    assert not [n for n in deepspeed.namelist() if n.endswith(".so")]     # DS_BUILD_OPS=0: nothing compiled
    assert "deepspeed/runtime/zero/stage3.py" in deepspeed.namelist()
    usage = subprocess.run(["bash", str(REPO / "tools" / "gpu_wheels.sh"), "--bogus"], capture_output=True, text=True,
                           timeout=60, cwd=REPO)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start_item_with_a_new_session_child(pidfile: Path) -> subprocess.Popen:
    """An item the way gpu_tests runs tests/torchrun.py: a process in a session of its own below it."""
    starts = ("import subprocess, sys, time; child = subprocess.Popen(['sleep', '300'], start_new_session=True); "
              f"open({str(pidfile)!r}, 'w').write(str(child.pid)); time.sleep(300)")
    item = subprocess.Popen([sys.executable, "-c", starts], start_new_session=True)
    for _ in range(600):
        if pidfile.exists() and pidfile.read_text().strip():
            return item
        time.sleep(0.1)
    raise AssertionError("the item did not start its child")


def test_processes_a_killed_item_started_in_other_sessions_die_with_it(tmp_path):
    """tests/torchrun.py starts torchrun and its ranks in a new session, outside the item's process
    group that gpu_check kills at the budget; they held the GPU for the next items. Hanging item:
    its new-session child is found below it. Item already killed (coreutils timeout kills it first):
    its orphan is re-parented to gpu_check (a child subreaper) and found there."""
    before = gpu_check._descendants()
    item = _start_item_with_a_new_session_child(tmp_path / "hanging.pid")
    child = int((tmp_path / "hanging.pid").read_text())
    assert os.getsid(child) != os.getsid(item.pid)                       # not in the item's session/group
    gpu_check.kill_item_processes(item, before)
    assert not _alive(child) and item.returncode is not None

    orphaned = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from tests.test_gpu_check import _start_item_with_a_new_session_child, gpu_check
gpu_check.become_subreaper()
before = gpu_check._descendants()
item = _start_item_with_a_new_session_child(Path({str(tmp_path / 'orphan.pid')!r}))
item.kill(); item.wait()                                   # the budget killed the item first
gpu_check.kill_item_processes(item, before)
print("cleaned")
"""
    out = subprocess.run([sys.executable, "-c", orphaned], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.stdout.strip() == "cleaned", out.stderr[-3000:]
    assert not _alive(int((tmp_path / "orphan.pid").read_text()))
