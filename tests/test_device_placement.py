"""Device placement on the GPU path, checked on the CPU (issue 18).

- the device guard (tests/device_guard.py) over a whole GRPO step of the policy: no tensor
  factory without ``device=`` in megadiv's code, no model-device tensor in an object broadcast;
- a lint over the GPU-reachable modules for the same factories (cheap, no model);
- sequence padding to FP8's multiple of 16 changes no log-prob, loss or gradient.
"""
import ast
from pathlib import Path

import pytest
import torch

from tests.device_guard import DeviceGuard
from tests.torchrun import run_torchrun

REPO = Path(__file__).resolve().parents[1]
# Modules whose code runs with the model's tensors during training steps and weight sync.
GPU_REACHABLE = ["megadiv/policy/megatron.py", "megadiv/policy/batches.py", "megadiv/trainer/grpo.py",
                 "megadiv/policy/objectives.py",
                 "megadiv/divergence/vocab_parallel.py", "megadiv/divergence/losses.py",
                 "megadiv/divergence/full_vocab.py", "megadiv/divergence/measures.py",
                 "megadiv/divergence/penalties.py", "megadiv/rollout/weight_sync.py", "megadiv/models/export.py"]
FACTORY_NAMES = {f.__name__ for f in __import__("tests.device_guard", fromlist=["FACTORIES"]).FACTORIES}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megadiv.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", tokenizer="bpe", vocab=301,
                               hidden=64, heads=4, kv_heads=2, ffn=128, layers=2))


@pytest.fixture(scope="module")
def placement(tiny_model):
    """One single-rank launch (gloo) running the guard and padding bodies."""
    (res,) = run_torchrun("tests.dist.device_placement:placement_checks", 1, timeout_s=400,
                          args={"hf_dir": tiny_model})
    return res


def test_guard_flags_a_deviceless_factory_and_a_device_tensor_in_an_object_broadcast(monkeypatch):
    """The guard itself: code compiled as a megadiv file that makes a tensor without device=, and a
    weight-derived tensor headed for broadcast_object_list, are both reported; explicit ones pass."""
    import torch.distributed as dist

    sent = []  # no process group here: the collective the guard wraps only records its payload
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, *a, **k: sent.append(objects))
    weight = torch.nn.Parameter(torch.ones(3))
    src = ("import torch, torch.distributed as dist\n"
           "def make(w):\n"
           "    a = torch.zeros(3)\n"                              # line 3: flagged
           "    b = torch.zeros(3, device=w.device)\n"
           "    c = torch.as_tensor(w * 2)\n"                      # a tensor keeps its device
           "    dist.broadcast_object_list([w * 2], src=0)\n"       # line 6: flagged
           "    dist.broadcast_object_list([(w * 2).cpu()], src=0)\n"
           "    return a, b, c\n")
    namespace = {}
    exec(compile(src, str(REPO / "megadiv" / "_guard_probe.py"), "exec"), namespace)
    recorder = dist.broadcast_object_list
    with DeviceGuard([weight]) as guard:
        namespace["make"](weight)
    assert guard.violations == [
        "megadiv/_guard_probe.py:3: torch.zeros without device=",
        "megadiv/_guard_probe.py:6: dist.broadcast_object_list of a tensor on the model's device (pickled with "
        "its device): move it to the host first"], guard.violations
    assert len(sent) == 2 and dist.broadcast_object_list is recorder  # both sent; the wrapper is gone


@pytest.mark.parametrize("path", GPU_REACHABLE)
def test_no_tensor_factory_without_device_in_gpu_reachable_code(path):
    """Every torch.<factory>(...) call in these modules names its device (the model's, the input's,
    or the host on purpose); torch.tensor/as_tensor of an existing tensor keep its device."""
    missing = []
    for node in ast.walk(ast.parse((REPO / path).read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORY_NAMES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            missing.append(f"{path}:{node.lineno}: torch.{node.func.attr}")
    assert not missing, missing


@pytest.mark.slow  # the torchrun launch it shares with the next test: about a minute on 2 cores
def test_policy_step_places_every_tensor_on_the_model_device(placement):
    """A GRPO step's worth of policy work (log-probs, KL in the reward, two updates with a
    full-vocabulary regulariser, metrics, the probe broadcast) under the device guard."""
    res = placement["guard"]
    assert res["violations"] == [], "\n".join(res["violations"])
    assert placement["harness"] == {"cuda_visible": "", "backend": "gloo", "cuda": False}  # CPU tier, any machine
    assert res["probe_tokens"] > 0 and res["loss"] == res["loss"]


@pytest.mark.slow
def test_padding_to_a_multiple_of_16_changes_no_loss_or_gradient(placement):
    """FP8 / sequence-parallel padding: the padded positions are cut before the loss (loss mask 0,
    and the sequence-length-normalised aggregation still sees the true length)."""
    res = placement["padding"]
    plain, padded = res[1], res[16]
    assert plain["seq_len"] == padded["seq_len"] == 9  # the batch itself is not padded; the model input is
    torch.testing.assert_close(padded["logp"], plain["logp"], rtol=0, atol=1e-6)
    for key in ("loss/total", "loss/policy", "loss/kl", "entropy"):
        assert padded["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-6, abs=1e-7), key
    for g_pad, g in zip(padded["grads"], plain["grads"]):
        torch.testing.assert_close(g_pad, g, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # a 2-rank torchrun launch: about a minute on 2 cores
def test_tp_markers_on_every_parameter_of_a_loaded_model(tiny_model):
    """Weights loaded, init skipped: every TP-split weight is marked with its split dimension
    (megatron < 0.19 marks them only in its init), every other parameter as replicated. That
    the grad norm then counts every shard is test_trainer_units' TP=2 == TP=1 grad-norm parity."""
    markers = run_torchrun("tests.dist.device_placement:tp_markers", 2, timeout_s=300, args={"hf_dir": tiny_model})
    assert markers[0] == markers[1]
    split = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0, "linear_qkv.weight": 0,
             "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_proj.weight": 1, "linear_fc2.weight": 1}
    assert len(markers[0]) > 10
    for name, (parallel, dim, stride) in markers[0].items():
        expected = next((d for suffix, d in split.items() if name.endswith(suffix)), None)
        assert (parallel, dim, stride) == ((True, expected, 1) if expected is not None else (False, -1, 1)), name
