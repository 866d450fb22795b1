"""A CPU stand-in for "the model is on a GPU": catch host/device mistakes without a GPU.

On a CPU machine every tensor is on the CPU, so a tensor megadiv forgets to put on the model's
device works here and fails at the first GPU step. :class:`DeviceGuard` records what a CUDA run
would reject, while the real code runs on the CPU:

1. a tensor factory (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...) called from megadiv's
   code without ``device=``: on a GPU it lands on the CPU next to CUDA operands, or goes into an
   NCCL collective ("No backend type associated with device type cpu");
2. an object collective (``broadcast_object_list`` and co.) whose payload holds a tensor derived
   from the model's weights without an explicit host copy (``.cpu()`` / ``.to("cpu")``): pickled
   with its CUDA device, it is unpickled onto another rank's GPU.

For (2) the guard tags the model's parameters as "on the model's device" and propagates the tag
through every torch call (an output is tagged when an input is; an in-place op tags its target);
an explicit host copy returns an untagged copy. Violations name the file and line.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

MEGADIV = str(Path(__file__).resolve().parents[1] / "megadiv") + "/"

FACTORIES = {torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.tensor, torch.as_tensor,
             torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace, torch.logspace,
             torch.empty_strided, torch.randperm}
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")
_TAG = "_megadiv_on_model_device"


def _is_host(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class DeviceGuard(TorchFunctionMode):
    """``with DeviceGuard(model_params) as guard: ...``; then ``guard.violations`` (list of str)."""

    def __init__(self, model_params):
        super().__init__()
        self.params = list(model_params)
        self.violations: list[str] = []  # each distinct one once, in order of occurrence
        self._saved = {}

    def __enter__(self):
        for p in self.params:
            setattr(p, _TAG, True)
        for name in OBJECT_COLLECTIVES:
            self._saved[name] = original = getattr(dist, name)
            setattr(dist, name, self._checked_collective(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)
        for p in self.params:
            if hasattr(p, _TAG):
                delattr(p, _TAG)
        return super().__exit__(*exc)

    def _report(self, violation: str) -> None:
        if violation not in self.violations:
            self.violations.append(violation)

    def _checked_collective(self, name, original):
        def wrapper(object_list, *args, **kwargs):
            for leaf in _walk(object_list):
                if isinstance(leaf, torch.Tensor) and getattr(leaf, _TAG, False):
                    self._report(f"{_megadiv_caller(1) or '?'}: dist.{name} of a tensor on the model's device "
                                 f"(pickled with its device): move it to the host first")
                    break
            return original(object_list, *args, **kwargs)
        return wrapper

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            data_is_tensor = func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], torch.Tensor)
            caller = _megadiv_caller(1)
            if caller and not data_is_tensor:
                self._report(f"{caller}: torch.{func.__name__} without device=")
        out = func(*args, **kwargs)
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        tagged = any(getattr(x, _TAG, False) for x in inputs)
        if not tagged:
            return out
        if _is_host_copy(func, args, kwargs):
            return out.clone() if out is args[0] else out  # CPU .cpu() returns self: the copy is the host one
        if getattr(func, "__name__", "").endswith("_") or func is torch.Tensor.__setitem__:
            setattr(args[0], _TAG, True)  # in place: the target now holds model-device data
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                try:
                    setattr(x, _TAG, True)
                except (AttributeError, RuntimeError):
                    pass
        return out


def _is_host_copy(func, args, kwargs) -> bool:
    if func is torch.Tensor.cpu:
        return True
    if func is torch.Tensor.to:
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return isinstance(target, (str, torch.device)) and _is_host(target)
    return False


def _megadiv_caller(depth: int) -> str | None:
    """'megadiv/x.py:123' when the frame ``depth`` above the caller is megadiv's code."""
    frame = sys._getframe(depth + 1)
    name = frame.f_code.co_filename
    if name.startswith(MEGADIV):
        return f"megadiv/{name[len(MEGADIV):]}:{frame.f_lineno}"
    return None


def _walk(obj, depth: int = 0):
    """Every leaf of lists, tuples, dicts and dataclass-like objects (their __dict__)."""
    if depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _walk(x, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _walk(x, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from _walk(vars(obj), depth + 1)
