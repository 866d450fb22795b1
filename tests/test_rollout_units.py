"""Rollout pieces that need no engine: config validation, bucket flattening, the weight manifest,
the launch command and environment of a CPU server, the probe's limit and answers."""
import dataclasses
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from megadiv.config import ConfigError, from_dict
from megadiv.rollout import (
    RolloutConfig,
    RolloutError,
    SamplingParams,
    WeightSyncError,
    probe_limit,
    resolve_engine_name,
)
from megadiv.rollout.engine import split_evenly
from megadiv.rollout.mismatch import real_prefix, spread
from megadiv.rollout.sglang_engine import resolve_sync_method
from megadiv.rollout.sglang_server import (
    CPU_STANDINS,
    GpuPlacement,
    TrainerMemory,
    child_env,
    gather_trainer_memory,
    launch_command,
    place_server,
    served_model_flags,
)
from megadiv.rollout.weight_sync import check_bucket, exported_ahead, flatten_bucket, read_manifest


@pytest.mark.parametrize("key, value", [
    ("n_samples", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("max_new_tokens", 0),
    ("bucket_bytes", 0), ("sync_timeout_s", 0.0), ("probe_floor", 0.0), ("probe_factor", 0.5),
    ("probe_max_limit", 0.05), ("server_urls", ("node7:30000",)),
    ("stop_token_ids", (-1,)), ("mem_fraction_static", 1.0), ("server_tp", 0), ("num_servers", 0),
    ("server_urls", ("http://a:1", "http://a:1")), ("server_python", "python3"),
])
def test_config_rejects_bad_values_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"rollout.{key}"):
        RolloutConfig(**{key: value})


def test_config_loads_from_yaml_dict_with_types_checked():
    cfg = from_dict(RolloutConfig, {"engine": "sglang", "server_urls": ["http://a:1", "http://b:2"],
                                    "sync_method": "disk", "stop_token_ids": [2, 7]})
    assert cfg.server_urls == ("http://a:1", "http://b:2") and cfg.stop_token_ids == (2, 7)
    with pytest.raises(ConfigError, match="sync_method"):
        from_dict(RolloutConfig, {"sync_method": "nccl"})
    with pytest.raises(ConfigError, match="server_urls"):
        RolloutConfig(engine="embedded", server_urls=("http://a:1",))
    assert SamplingParams.from_config(cfg).stop_token_ids == (2, 7)


def test_a_fleet_is_launched_or_attached_not_both():
    with pytest.raises(ConfigError, match="rollout.num_servers .*set one of the two"):
        RolloutConfig(engine="sglang", num_servers=2, server_urls=("http://a:1", "http://b:2"))
    with pytest.raises(ConfigError, match="rollout.num_servers .*engine 'sglang'"):
        RolloutConfig(engine="embedded", num_servers=2)
    assert resolve_engine_name(RolloutConfig(num_servers=2)) == "sglang"


def test_fleet_splits_prompts_in_order_with_balance():
    """Contiguous prompt slices, sizes differing by at most one: a prompt's samples (its group)
    stay on one server and the concatenated results keep prompt order."""
    assert split_evenly(5, 2) == [slice(0, 3), slice(3, 5)]
    assert split_evenly(2, 3) == [slice(0, 1), slice(1, 2), slice(2, 2)]
    assert [s.stop - s.start for s in split_evenly(17, 4)] == [5, 4, 4, 4]


def test_flatten_bucket_aligns_every_tensor_and_round_trips():
    """SGLang rebuilds tensor i from bytes [offset_i, offset_i + nbytes_i) and rejects an offset
    that is not a multiple of its element size: odd-sized small-dtype tensors must not come first."""
    bucket = [("a", torch.arange(3, dtype=torch.bfloat16)), ("b", torch.randn(2, 3)),
              ("c", torch.arange(5, dtype=torch.int8)), ("d", torch.randn(4, dtype=torch.float64))]
    flat, fields = flatten_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == 3 * 2 + 6 * 4 + 5 + 4 * 8
    offset, original = 0, dict(bucket)
    for name, dtype, shape in zip(fields["names"], fields["dtypes"], fields["shapes"]):
        dt = getattr(torch, dtype)
        n = torch.Size(shape).numel() * dt.itemsize
        assert offset % dt.itemsize == 0, f"{name} at unaligned offset {offset}"
        assert torch.equal(flat[offset:offset + n].view(dt).view(shape), original[name])
        offset += n
    assert sorted(fields["names"]) == ["a", "b", "c", "d"] and fields["load_format"] == "flattened_bucket"


def test_the_next_bucket_is_exported_while_this_one_is_sent():
    """exported_ahead (what a fleet sync consumes): while the caller sends bucket k, bucket k+1 is
    produced (the caller waits for it inside its send: a plain iteration would never produce it);
    never more than one bucket ahead; order kept; the producer's error raised after the buckets
    before it; a caller that stops early ends the producer."""
    produced = [threading.Event() for _ in range(5)]

    def export(n: int, fail_at: int | None = None):
        for k in range(n):
            if k == fail_at:
                raise RuntimeError("export failed at bucket 2")
            produced[k].set()
            yield [(f"w{k}", torch.full((2,), float(k)))]

    received = []
    for bucket in exported_ahead(export(5)):
        k = len(received)
        received.append(bucket[0][0])
        assert k + 2 >= 5 or not produced[k + 2].is_set()  # one ahead at most: k+2 waits for k+1 to be taken
        if k + 1 < 5:  # "sending" bucket k: bucket k+1 is exported meanwhile
            assert produced[k + 1].wait(timeout=60), f"bucket {k + 1} was not exported while {k} was sent"
    assert received == [f"w{k}" for k in range(5)]
    with pytest.raises(RuntimeError, match="export failed at bucket 2"):
        got = []
        for bucket in exported_ahead(export(5, fail_at=2)):
            got.append(bucket[0][0])
    assert got == ["w0", "w1"]
    ahead = exported_ahead(export(5))
    next(ahead)
    ahead.close()  # a failed sync stops reading
    deadline = time.monotonic() + 60
    while any(t.name == "megadiv-export" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "megadiv-export" for t in threading.enumerate())


def test_manifest_and_bucket_check(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4), "model.norm.weight": torch.zeros(4, dtype=torch.bfloat16)},
              str(tmp_path / "model-00001.safetensors"))
    manifest = read_manifest(tmp_path)
    assert manifest == {"model.embed_tokens.weight": ((10, 4), torch.float32), "model.norm.weight": ((4,), torch.bfloat16)}
    assert read_manifest(tmp_path / "absent") is None
    check_bucket([("model.norm.weight", torch.ones(4))], manifest, "bucket 0")  # dtype may differ: the loader casts
    with pytest.raises(WeightSyncError, match=r"bucket 3: tensor 'model.nrom.weight' is not a weight"):
        check_bucket([("model.nrom.weight", torch.ones(4))], manifest, "bucket 3")
    with pytest.raises(WeightSyncError, match=r"shape \(4, 10\), the served model's is \(10, 4\)"):
        check_bucket([("model.embed_tokens.weight", torch.ones(4, 10))], manifest, "bucket 0")


def test_cpu_server_command_and_environment(tmp_path, monkeypatch):
    cfg = RolloutConfig(engine="sglang", server_args=("--max-running-requests", "8"))
    cmd = launch_command("/ckpt", 31234, cfg, None)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "127.0.0.1" in cmd and "31234" in cmd
    for flag in ("--device", "--attention-backend", "--sampling-backend", "--skip-server-warmup", "--sleep-on-idle"):
        assert flag in cmd
    assert cmd[-2:] == ["--max-running-requests", "8"]
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")      # the trainer's TP overlap setting: not the server's
    env = child_env(cuda=False)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env and "CUDA_DEVICE_MAX_CONNECTIONS" not in child_env(cuda=True)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["PYTHONPATH"].split(":")[0] == str(CPU_STANDINS)
    assert "SGLANG_USE_CPU_ENGINE" not in child_env(cuda=True)

    assert cmd[cmd.index("--dtype") + 1] == "float32"        # the CPU tier serves float32

    gpu = launch_command(str(tiny_config(tmp_path)), 31234, dataclasses.replace(cfg, server_tp=2),
                         GpuPlacement(4, False, 0.7))
    assert gpu[gpu.index("--tp-size") + 1] == "2" and "--device" not in gpu
    assert gpu[gpu.index("--base-gpu-id") + 1] == "4" and gpu[gpu.index("--mem-fraction-static") + 1] == "0.7"
    assert gpu[gpu.index("--dtype") + 1] == "bfloat16" and gpu[gpu.index("--attention-backend") + 1] == "triton"
    assert gpu[-2:] == ["--max-running-requests", "8"]           # server_args last: they override
    with pytest.raises(ValueError, match="server_tp"):
        launch_command("/ckpt", 1, dataclasses.replace(cfg, server_tp=2), None)


def _python_without_sglang(tmp_path) -> str:
    """A real interpreter that cannot find sglang: this one, isolated (-I: no site-packages)."""
    wrapper = tmp_path / "python-bare"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def test_server_python_runs_launched_servers_and_is_checked(tmp_path, monkeypatch):
    """rollout.server_python (the container keeps sglang in /opt/sglang, not in the trainer's
    Python): it starts the server command; unset, the container's SGLang Python where it exists,
    else this interpreter. check-config's preflight refuses one that cannot find sglang, and a
    server_python where nothing is launched; 'auto' picks sglang by the server's Python."""
    import megadiv.rollout.factory as factory
    from megadiv.cli import preflight
    from megadiv.config import ModelConfig
    from megadiv.rollout import sglang_server
    from megadiv.trainer.config import TrainConfig, WarmStartConfig

    assert launch_command("/ckpt", 1, RolloutConfig(engine="sglang"), None)[0] == (
        sglang_server.CONTAINER_SGLANG_PYTHON if sglang_server.os.access(sglang_server.CONTAINER_SGLANG_PYTHON,
                                                                         sglang_server.os.X_OK) else sys.executable)
    bare = _python_without_sglang(tmp_path)
    cfg = RolloutConfig(engine="sglang", server_python=bare)
    assert launch_command("/ckpt", 1, cfg, None)[0] == bare
    monkeypatch.setattr(sglang_server, "CONTAINER_SGLANG_PYTHON", bare)      # a container without sglang there
    assert sglang_server.server_python(RolloutConfig()) == bare
    assert not sglang_server.finds_sglang(bare) and sglang_server.finds_sglang(sys.executable)
    assert not sglang_server.finds_sglang(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=f"rollout.server_python: {bare} cannot import sglang"):
        sglang_server.check_server_python(cfg)
    sglang_server.check_server_python(RolloutConfig(engine="sglang", server_python=sys.executable))
    for nothing_launched in ({"engine": "embedded"}, {"server_urls": ("http://a:1",)}):
        with pytest.raises(ConfigError, match="rollout.server_python runs launched servers; this config launches none"):
            RolloutConfig(server_python=bare, **nothing_launched)
    # the engines on servers a config launched (the fleet's members and sync, the driver's view) attach to them
    attached = RolloutConfig(engine="sglang", num_servers=2, server_python=bare).attached(["http://a:1", "http://b:2"])
    assert (attached.server_urls, attached.num_servers, attached.server_python) == (("http://a:1", "http://b:2"), 1, None)
    # auto: CUDA and a server Python with sglang (here: the stand-in container Python has none)
    monkeypatch.setattr(factory.torch.cuda, "is_available", lambda: True)
    assert resolve_engine_name(RolloutConfig()) == "embedded"
    assert resolve_engine_name(RolloutConfig(server_python=sys.executable)) == "sglang"
    # preflight (check-config, train): the server's Python, and 'tensor' sync in the trainer's
    def train_cfg(**rollout):
        return TrainConfig(model=ModelConfig(hf_dir=str(tmp_path / "m")), warm_start=WarmStartConfig(make_model="qwen2"),
                           rollout=RolloutConfig(**rollout))
    with pytest.raises(ConfigError, match="cannot import sglang"):
        preflight._check_rollout(train_cfg(engine="sglang", server_python=bare))
    preflight._check_rollout(train_cfg(engine="sglang", server_python=sys.executable, sync_method="tensor"))
    # CUDA-IPC handles open only on the trainer's machine: an explicit 'tensor' to a remote server is refused
    with pytest.raises(ConfigError, match=r"^rollout.sync_method passes CUDA-IPC handles, which only a server on the "
                                          r"trainer's machine can open \(rollout.server_urls has \['http://a:1'\]\)"):
        RolloutConfig(engine="sglang", server_urls=("http://a:1", "http://127.0.0.1:2"), sync_method="tensor")
    RolloutConfig(engine="sglang", server_urls=("http://localhost:1", "http://127.0.0.1:2"), sync_method="tensor")


def test_distributed_sync_refuses_two_nccl_versions(tmp_path, monkeypatch):
    """On a GPU machine whose server Python is another environment (the container's /opt/sglang),
    preflight compares the NCCL both load (a faked device query here) and refuses a mismatch in one
    line before any rank starts: NCCL would refuse the broadcast group ("Mismatched NCCL version")."""
    from megadiv.cli import preflight
    from megadiv.config import ModelConfig
    from megadiv.rollout import sglang_server
    from megadiv.trainer.config import TrainConfig, WarmStartConfig

    other = tmp_path / "sglang-python"          # another interpreter path that finds sglang
    other.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    other.chmod(0o755)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    versions = {sys.executable: "2.28.9", str(other): "2.29.2"}
    monkeypatch.setattr(sglang_server, "nccl_version", lambda python: versions[python])

    def check(**rollout):
        preflight._check_rollout(TrainConfig(model=ModelConfig(hf_dir=str(tmp_path / "m")),
                                             warm_start=WarmStartConfig(make_model="qwen2"),
                                             rollout=RolloutConfig(engine="sglang", server_python=str(other), **rollout)))
    with pytest.raises(ConfigError, match=r"trainer \(NCCL 2.28.9\) and servers run by .* \(NCCL 2.29.2\), which NCCL "
                                          r"refuses: use sync_method 'disk'"):
        check()
    check(sync_method="disk")                    # no NCCL group between them
    versions[str(other)] = "2.28.9"
    check(sync_method="distributed")


# SGLang's side of a 'tensor' sync: patch its reductions as its scheduler does, fake the device
# query (GPU-server-uuid is device 5 here), unpickle with its safe unpickler, and print what torch's
# CUDA rebuild would have been called with.
_SGLANG_UNPICKLES = """
import sys, torch
from torch.multiprocessing import reductions
from sglang.srt.utils.common import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
torch.cuda.device_count = lambda: 8
torch.cuda.get_device_properties = lambda i: type("P", (), {"uuid": "GPU-server-uuid" if i == 5 else f"GPU-{i}"})
monkey_patch_torch_reductions()
calls = []
reductions._rebuild_cuda_tensor_original = lambda *args: calls.append(args) or args[0]
named = MultiprocessingSerializer.deserialize(sys.stdin.read())
(name, cls), = named
args = calls[0]
print(name, cls.__name__, list(args[1]), args[4].__name__, str(args[5]), args[6], args[7].decode())
"""


def test_tensor_sync_pickles_handles_without_sglang_that_sglang_rebuilds_on_the_right_gpu(monkeypatch):
    """'auto' picks 'tensor' for a server on the trainer's GPUs, and the container's trainer Python
    has no sglang: the CUDA-IPC payload is made with torch alone (sglang's import fails here), names
    the GPU by UUID, and SGLang 0.5.23's own deserializer (its safe unpickler and patched rebuild,
    in a second Python) accepts it and maps the UUID to its own device index. The CUDA parts (the
    handle, the device query) are faked; what runs on a GPU is named in docs/performance.md."""
    from torch.multiprocessing import reductions

    from megadiv.rollout import weight_sync

    monkeypatch.setitem(sys.modules, "sglang", None)            # any sglang import raises ImportError
    tensor = torch.zeros(2, 3)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"uuid": "GPU-server-uuid" if i == 1 else f"GPU-{i}"}))

    def reduce_cuda(t):   # torch's tuple for a tensor on the trainer's device 1
        return reductions.rebuild_cuda_tensor, (type(t), t.size(), t.stride(), 0, torch.UntypedStorage, t.dtype, 1,
                                                b"ipc-handle", 24, 0, False, b"ref", 0, b"event", True)
    monkeypatch.setattr(reductions, "reduce_tensor", reduce_cuda)
    payload = weight_sync.serialize_bucket([("model.embed_tokens.weight", tensor)])
    out = subprocess.run([sys.executable, "-c", _SGLANG_UNPICKLES], input=payload, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["model.embed_tokens.weight", "Tensor", "[2,", "3]", "UntypedStorage",
                                  "torch.float32", "5", "ipc-handle"]
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: False))
    with pytest.raises(WeightSyncError, match="^sync_method 'tensor' needs CUDA tensors"):
        weight_sync.serialize_bucket([("w", tensor)])


def tiny_config(root, **fields):
    """A config.json like the tiny test models' (float32, hidden 64, 4 heads: head dim 16)."""
    import json

    (root / "ckpt").mkdir(exist_ok=True)
    config = {"hidden_size": 64, "num_attention_heads": 4, "torch_dtype": "float32", **fields}
    (root / "ckpt" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return root / "ckpt"


def test_gpu_server_dtype_and_attention_backend(tmp_path):
    """float32 checkpoints are served in bf16 (SGLang's auto picks float16), bf16/fp16 as stored;
    head dims other than 64/128/256 get the Triton attention backend."""
    assert served_model_flags(str(tiny_config(tmp_path))) == ["--dtype", "bfloat16", "--attention-backend", "triton"]
    assert served_model_flags(str(tiny_config(tmp_path, torch_dtype=None, hidden_size=128))) == \
        ["--dtype", "bfloat16", "--attention-backend", "triton"]           # no dtype stored: float32
    qwen3 = tiny_config(tmp_path, hidden_size=4096, num_attention_heads=32, head_dim=128, torch_dtype="bfloat16")
    assert served_model_flags(str(qwen3)) == ["--dtype", "bfloat16"]
    assert served_model_flags(str(tiny_config(tmp_path, hidden_size=2048, num_attention_heads=32,
                                              torch_dtype=None, dtype="float16"))) == ["--dtype", "float16"]


def test_launched_server_placement_and_sync_method():
    """GPUs free after the trainer's: the server takes them and a broadcast group works. One GPU
    (or too few): the server shares GPU 0.. with the trainer, gets its memory share minus the
    trainer's optimizer state, and 'auto' syncs by CUDA-IPC handles; 'distributed' is refused
    before anything starts (NCCL refuses two ranks on one GPU)."""
    cfg = RolloutConfig(engine="sglang", mem_fraction_static=0.8)
    own = place_server(cfg, trainer_gpus=4, visible_gpus=8)
    assert own == GpuPlacement(base_gpu_id=4, shares_trainer_gpus=False, mem_fraction_static=0.8)
    assert resolve_sync_method(cfg, own) == "distributed"
    gib = 1 << 30
    shared = place_server(cfg, trainer_gpus=1, visible_gpus=1, memory=TrainerMemory((100 * gib,), (10 * gib,)))
    assert shared == GpuPlacement(base_gpu_id=0, shares_trainer_gpus=True, mem_fraction_static=0.7)
    assert resolve_sync_method(cfg, shared) == "tensor"
    assert resolve_sync_method(dataclasses.replace(cfg, sync_method="disk"), shared) == "disk"
    with pytest.raises(ValueError, match="NCCL refuses two ranks of one group on one GPU"):
        resolve_sync_method(dataclasses.replace(cfg, sync_method="distributed"), shared)
    assert resolve_sync_method(cfg, None) == "distributed"  # CPU, or attached servers
    with pytest.raises(RolloutError, match=r"would get 0\.014.*state on GPU 0 \(110\.0 GiB of 140\.0 GiB free\)"):
        place_server(cfg, trainer_gpus=1, visible_gpus=1, memory=TrainerMemory((140 * gib,), (110 * gib,)))
    with pytest.raises(RolloutError, match=r"server_tp=2 needs GPUs 0\.\.1; 1 are visible"):
        place_server(dataclasses.replace(cfg, server_tp=2), trainer_gpus=1, visible_gpus=1)
    # a fleet: server i takes the i-th group of server_tp free GPUs, or shares the trainer's i-th group
    tp2 = dataclasses.replace(cfg, server_tp=2)
    assert [place_server(tp2, trainer_gpus=4, visible_gpus=8, index=i).base_gpu_id for i in (0, 1)] == [4, 6]
    assert place_server(tp2, trainer_gpus=8, visible_gpus=8, index=1) == GpuPlacement(2, True, 0.8)   # none measured
    with pytest.raises(RolloutError, match=r"rollout server 4 .* needs GPUs 8\.\.9; 8 are visible"):
        place_server(tp2, trainer_gpus=8, visible_gpus=8, index=4)


def sglang_sizes(fraction: float, free: list[int], weights: int) -> list[int]:
    """What SGLang 0.5.23 leaves free on each of a server's TP GPUs after its weights and KV cache:
    pre = the least free memory of its GPUs at start (bootstrap.measure_pre_model_load_memory,
    distributed min); KV = min(free after loading) - pre x (1 - fraction)
    (kv_cache_configurator._profile_available_bytes), the same on every GPU."""
    pre = min(free)
    kv = min(f - weights for f in free) - pre * (1 - fraction)
    assert kv > 0
    return [f - weights - kv for f in free]


def test_colocated_memory_share_follows_sglangs_formula(monkeypatch):
    """A server at TP=2 on two trainer GPUs holding unequal memory (GPU 1 has 20 GiB less free; its
    rank's optimizer state is smaller): after SGLang sizes itself with the share megadiv computes and
    each trainer rank allocates its optimizer state, every GPU keeps (1 - F) of what was free for
    activations, the binding GPU exactly. Free memory comes from torch.cuda.mem_get_info (faked)."""
    gib = 1 << 30
    cfg = RolloutConfig(engine="sglang", mem_fraction_static=0.8, server_tp=2)
    free, total = [100 * gib, 80 * gib], 141 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], total))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("GROUP_RANK", "0")
    measured = gather_trainer_memory(reserved_bytes=10 * gib)       # one process: no group to gather over
    assert measured == TrainerMemory((100 * gib,), (10 * gib,))
    memory = TrainerMemory(tuple(free), (10 * gib, 6 * gib))
    placed = place_server(cfg, trainer_gpus=2, visible_gpus=2, memory=memory)
    assert placed.shares_trainer_gpus and placed.base_gpu_id == 0
    left = [f - r for f, r in zip(sglang_sizes(placed.mem_fraction_static, free, weights=3 * gib), memory.reserved_bytes)]
    need = [(1 - cfg.mem_fraction_static) * f for f in free]
    assert all(lft >= n for lft, n in zip(left, need)), (left, need)
    assert min(lft - n for lft, n in zip(left, need)) < 1e-4 * free[1]   # the binding GPU: exact up to rounding
    # the former base, the GPU's total memory, under-reserved the optimizer state by free / total
    one = TrainerMemory((100 * gib,), (10 * gib,))
    old = cfg.mem_fraction_static - 10 * gib / total
    assert sglang_sizes(old, [100 * gib], gib)[0] - 10 * gib < 0.2 * 100 * gib
    new = place_server(dataclasses.replace(cfg, server_tp=1), trainer_gpus=1, visible_gpus=1, memory=one)
    assert new.mem_fraction_static == pytest.approx(0.7, abs=1e-4)


@pytest.mark.sglang
def test_colocated_tp_server_turns_sglangs_memory_balance_check_into_a_warning():
    """SGLang refuses a TP server whose GPUs' free memory differs by over 10% (its check is on by
    default); beside the trainer it is sized against the least free GPU, so the check is off there.
    Read by SGLang's own settings module in the environment the server gets."""
    read = "from sglang.srt.environ import envs; print(envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get())"
    for shares, expected in ((True, "False"), (False, "True")):
        env = child_env(cuda=True, shares_trainer_gpus=shares)
        out = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=300)
        assert out.stdout.strip().splitlines()[-1] == expected, out.stderr[-2000:]


def test_a_server_launched_by_a_trainer_rank_does_not_join_its_rendezvous(monkeypatch):
    """Under torchrun, RANK / WORLD_SIZE / MASTER_PORT name the trainer's group: a server that
    inherited them would wait in torch.distributed's init for ranks that never come."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "MEGADIV_KEEP": "1"}.items():
        monkeypatch.setenv(key, value)
    env = child_env(cuda=False)
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    assert env["MEGADIV_KEEP"] == "1"


def test_cpu_standins_are_not_importable_in_the_trainer():
    import importlib.util
    assert importlib.util.find_spec("sgl_kernel") is None
    assert importlib.util.find_spec("torchvision") is None


def test_sgl_kernel_standin_matches_the_triton_kernel_semantics():
    """assign_req_to_token_pool: request i's slots out_cache_loc[sum_{j<i} len_j : ... + len_i]
    land in row req_pool_indices[i], columns start_i:end_i; nothing else changes."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", CPU_STANDINS / "sgl_kernel" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    table = torch.full((4, 8), -1, dtype=torch.int32)
    mod.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), table, torch.tensor([1, 3]), torch.tensor([4, 5]),
                                     torch.tensor([10, 11, 12, 20, 21], dtype=torch.int32), 8)
    expected = torch.full((4, 8), -1, dtype=torch.int32)
    expected[2, 1:4] = torch.tensor([10, 11, 12], dtype=torch.int32)
    expected[0, 3:5] = torch.tensor([20, 21], dtype=torch.int32)
    assert torch.equal(table, expected)
    with pytest.raises(NotImplementedError, match="fused_experts_cpu"):
        mod.fused_experts_cpu()


def test_probe_limit_scales_with_the_baseline_up_to_the_cap():
    """max(probe_floor, probe_factor x baseline): a float32 baseline leaves the floor, bf16 noise
    raises the limit with it, and a baseline whose limit would pass an O(1) shift (or NaN) is an
    error at the start of the run."""
    cfg = RolloutConfig(probe_floor=0.05, probe_factor=4.0, probe_max_limit=1.0)
    assert probe_limit(2e-7, cfg) == 0.05
    assert probe_limit(0.03, cfg) == pytest.approx(0.12)
    assert probe_limit(0.25, cfg) == 1.0
    for baseline in (0.26, float("nan")):
        with pytest.raises(WeightSyncError, match="on identical weights.*rollout.probe_max_limit=1"):
            probe_limit(baseline, cfg)


@pytest.mark.parametrize("key, replacement", [("mismatch_threshold", "rollout.probe_floor"),
                                              ("mismatch_threshold_fp8", "rollout.probe_factor"),
                                              ("probe_prompt_len", "whole held-out prompts")])
def test_retired_probe_keys_are_refused_with_their_replacement(key, replacement):
    from megadiv.trainer.config import TrainConfig

    with pytest.raises(ConfigError, match=f"'rollout.{key}' is no longer taken: .*{replacement}"):
        from_dict(TrainConfig, {"rollout": {key: 0.1}})


def test_probe_prompts_are_spread_and_answers_cut_before_padding():
    assert spread(10, 4) == [0, 2, 5, 7] and spread(2, 4) == [0, 0, 1, 1]  # fewer problems than probe rows
    assert real_prefix([5, 99, 100, 3], real_vocab=100) == [5, 99] and real_prefix([100, 3], 100) == []


@pytest.mark.parametrize("starts, expected_wait", [
    ({"http://a": 10, "http://b": 12}, 12),         # both starting: until the later one answers
    ({"http://a": 0, "http://b": None}, 5),         # one dead at a restart: the grace, not the start-up timeout
    ({"http://a": 0, "http://b": 30}, 5),           # one far behind: left out, rejoins before a later push
    ({"http://a": 20, "http://b": None}, 25),       # the grace runs from the first answer
    ({"http://a": None, "http://b": None}, 600),    # none answers: the whole start-up timeout
])
def test_attached_servers_are_waited_for_until_each_answers_or_the_grace_after_the_first(monkeypatch, starts,
                                                                                         expected_wait):
    """fleet.wait_for_attached on a fake clock: servers answer /health from their start time on
    (None: never); the start-up timeout is 600 s and the grace after the first answer 5 s."""
    from megadiv.rollout import fleet

    clock = [0.0]
    monkeypatch.setattr(fleet.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(fleet.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(fleet, "answers", lambda url: starts[url] is not None and clock[0] >= starts[url])
    fleet.wait_for_attached(list(starts), timeout_s=600, grace_s=5)
    assert clock[0] == expected_wait
