"""Let megatron-core run on a CUDA-less torch (the CPU tier: tests, CI, the tiny demo).

megatron-core assumes a GPU in a handful of places that have nothing to do with the maths:
scratch buffers and communication outputs allocated on ``torch.cuda.current_device()``, scalars
created with ``device="cuda"``, ``torch.cuda.synchronize()`` around p2p, and string type checks
against ``'torch.cuda.FloatTensor'``. This module redirects exactly those to the CPU, and only
while enabled. It is enabled by :func:`megadiv.parallel.initialize` when
``torch.cuda.is_available()`` is False, never on a GPU machine, and it logs what it changed once.

Where megatron has a flag that avoids a CUDA call, megadiv sets the flag instead of patching:
``model_parallel_cuda_manual_seed(..., inference_rng_tracker=True)`` (no CUDA RNG state; fine
because megadiv trains with dropout 0) and ``batch_p2p_sync=False`` in the model config (no
``torch.cuda.synchronize()`` after batched p2p). docs/cpu.md lists every patch with the
megatron-core 0.16.1 lines it addresses.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily

from megadiv.parallel.quiet import ALL_WARNINGS

log = logging.getLogger(__name__)

# megatron-core releases this layer was run against (full test suite on CPU).
TESTED_MEGATRON_VERSIONS = ("0.16.1",)

# CPU tensor type -> the CUDA type name megatron's optimizer asserts on.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device='cuda'`` in any torch call to the CPU, and answers ``Tensor.type()`` with
    the CUDA type name (megatron's optimizers compare ``param.type()`` with
    ``'torch.cuda.FloatTensor'``; the tensors themselves stay on the CPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


class _State:
    mode: _CudaToCpu | None = None
    saved: dict = {}


@functools.lru_cache(maxsize=64)
def _causal_mask_on_cpu(sq: int) -> torch.Tensor:
    """megatron's get_default_causal_mask (transformer/utils.py:35, device="cuda") on the CPU,
    made once per length: True above the diagonal (masked)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool, device="cpu"), diagonal=1)


def _recompute_backward_on_cpu(ctx, *grads):
    with _CudaToCpu():
        return _State.saved["recompute_backward"](ctx, *grads)


def enabled() -> bool:
    return _State.mode is not None


def enable(allow_untested: bool = False) -> None:
    """Switch the layer on (idempotent). Refuses on a machine with CUDA and, unless
    ``allow_untested``, on a megatron-core version not in TESTED_MEGATRON_VERSIONS."""
    if enabled():
        return
    if torch.cuda.is_available():
        raise RuntimeError("megadiv's CPU compatibility layer is for CUDA-less machines only")
    import megatron.core

    version = megatron.core.__version__
    if version not in TESTED_MEGATRON_VERSIONS and not allow_untested:
        raise RuntimeError(
            f"megatron-core {version} has not been tested with megadiv's CPU compatibility layer "
            f"(tested: {', '.join(TESTED_MEGATRON_VERSIONS)}); set parallel.allow_untested_megatron=true "
            f"to try it anyway")
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as tp_random

    _State.saved = {"current_device": torch.cuda.current_device, "synchronize": torch.cuda.synchronize,
                    "get_rng": tp_random._get_cuda_rng_state, "set_rng": tp_random._set_cuda_rng_state,
                    "recompute_backward": tp_random.CheckpointFunction.backward,
                    "causal_mask": fused_softmax.get_default_causal_mask}
    # megatron-core utils.py:631, tensor_parallel/mappings.py:91,141,148,181, p2p_communication.py:190-202,
    # optimizer.py:1141, distrib_optimizer.py:791 allocate on torch.cuda.current_device().
    torch.cuda.current_device = lambda: "cpu"
    # pipeline_parallel/p2p_communication.py:242 and :398 synchronise the stream around p2p.
    torch.cuda.synchronize = lambda device=None: None
    # pipeline_parallel/schedules.py:596,983,2138; optimizer/optimizer.py:473,481,485,907;
    # optimizer/clip_grads.py:90,103,115,174,207 create tensors with device="cuda";
    # optimizer.py:671,690, distrib_optimizer.py:361,420,582, clip_grads.py:167 check param.type().
    # tensor_parallel/random.py:447,457: activation recompute (CheckpointFunction) saves and restores
    # the CUDA RNG state around the recomputed forward; there is none (and dropout is 0).
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    # The recomputed forward runs inside autograd's backward, where torch function modes are not
    # active: CheckpointFunction.backward (tensor_parallel/random.py:530) re-enters the mode, e.g.
    # for the causal mask made with device="cuda" (transformer/utils.py:35).
    tp_random.CheckpointFunction.backward = staticmethod(_recompute_backward_on_cpu)
    # fusions/fused_softmax.py:327, the attention's causal mask: the one device="cuda" call in the
    # model's forward (docs/cpu.md, row 8; every CPU test runs the forward paused), so the forward can run
    # without the mode (paused)
    fused_softmax.get_default_causal_mask = _causal_mask_on_cpu
    _State.mode = _CudaToCpu()
    _State.mode.__enter__()
    if os.environ.get("RANK", "0") == "0" or os.environ.get(ALL_WARNINGS) == "1":  # once per job, not per rank
        log.warning(
            "megadiv CPU compatibility layer on (megatron-core %s): torch.cuda.current_device() -> 'cpu', "
            "torch.cuda.synchronize() -> no-op, device='cuda' arguments -> cpu, Tensor.type() reports "
            "torch.cuda.* names, Tensor.cuda() -> identity, no CUDA RNG state around recompute. See docs/cpu.md.",
            version)


def disable() -> None:
    if not enabled():
        return
    _State.mode.__exit__(None, None, None)
    torch.cuda.current_device = _State.saved["current_device"]
    torch.cuda.synchronize = _State.saved["synchronize"]
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state, tp_random._set_cuda_rng_state = _State.saved["get_rng"], _State.saved["set_rng"]
    tp_random.CheckpointFunction.backward = staticmethod(_State.saved["recompute_backward"])
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = _State.saved["causal_mask"]
    _State.mode = None


@contextlib.contextmanager
def paused():
    """The body without the mode, where nothing needs it: every torch call under the mode pays a
    Python round trip (~1.5 us), ~2,000 per forward of the tiny demo model, 3% of a CPU training
    step (docs/performance.md). Used around the model's forward (megatron's GPTModel, whose one
    device="cuda" call is patched above, and the embedded engine's transformers model). No-op when
    the layer is off or another mode is on top of it (a profiler's, a test's)."""
    if _State.mode is None or _get_current_function_mode() is not _State.mode:
        yield
        return
    with _pop_mode_temporarily():
        yield
