"""Run megatron-core on a machine without CUDA (gloo, CPU tensors), for tests and smoke runs.

megatron-core hard-codes CUDA in a few places: ``device="cuda"`` / ``torch.cuda.current_device()`` when
allocating buffers, ``Tensor.cuda()``, ``param.type() == "torch.cuda.FloatTensor"`` checks in the optimizers,
``torch.cuda.synchronize()`` and the CUDA RNG state tracker of tensor parallelism. :func:`activate` adapts
exactly these, and only when CUDA is absent:

- a :class:`torch.overrides.TorchFunctionMode` maps CUDA devices in factory calls and ``Tensor.to/.cuda`` to
  CPU, and reports CPU tensor types under their CUDA names (so the type checks accept them);
- ``torch.cuda.current_device/synchronize/...`` become harmless shims;
- the model-parallel RNG tracker keeps CPU generator states instead of CUDA ones.

On a CUDA machine :func:`activate` returns ``False`` and changes nothing.

Only entry points call :func:`activate` (``pretrain_vlm``'s ``main``, each converter rank's start, ``mmpack demo``),
never library code and never at import: it changes torch for the whole process. Library code that needs a
backend asks :func:`require_backend`, which names the missing set-up instead of failing deep in megatron-core
(``tests/test_architecture.py`` checks both).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()  # two threads activating at once install the backend once


def _to_cpu_device(device: Any) -> Any:
    """Map a CUDA device designation (str, torch.device, int index) to CPU; leave anything else alone."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placements to CPU for every torch call made while the mode is active."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:  # .to(device, ...); a dtype or tensor passes unchanged
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Optimizers check `param.type() == "torch.cuda.FloatTensor"`; CPU tensors play that part here.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def is_active() -> bool:
    """True once :func:`activate` has installed the CPU backend in this process (torch's own state says:
    its shim is torch.cuda's current_device)."""
    return torch.cuda.current_device is _cpu_current_device


def _install_cuda_shims() -> None:
    cuda = torch.cuda
    # A device object, not an index: autograd runs custom backward functions outside the function mode,
    # and those allocate with `device=torch.cuda.current_device()`.
    cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    cuda.empty_cache = lambda: None  # type: ignore[assignment]
    cuda.set_device = lambda device: None  # type: ignore[assignment]
    cuda.device_count = lambda: 0  # type: ignore[assignment]
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)  # type: ignore[assignment]
    # The CPU generator stands in for the device generator (torch.manual_seed already seeds "all CUDA").
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
    cuda.max_memory_allocated = lambda device=None: 0  # type: ignore[assignment]
    cuda.memory_allocated = lambda device=None: 0  # type: ignore[assignment]


def _install_cpu_rng_tracker() -> None:
    """Make the tensor-parallel RNG tracker fork/restore the CPU generator instead of a CUDA one."""
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mp_random._get_cuda_rng_state = get_state  # type: ignore[assignment]
    mp_random._set_cuda_rng_state = set_state  # type: ignore[assignment]


def require_backend(what: str) -> bool:
    """Whether ``what`` runs on the CPU backend (True) or on CUDA (False); RuntimeError when CUDA is absent and
    the process's entry point did not call :func:`activate`."""
    if is_active():
        return True
    if torch.cuda.is_available():
        return False
    raise RuntimeError(
        f"{what}: no CUDA here and the CPU backend is not set up; the entry point calls "
        "mmpack.trainer.cpu_backend.activate() first (as pretrain_vlm's main does)"
    )


def activate() -> bool:
    """Install the CPU backend if CUDA is absent. Idempotent; returns whether it is active."""
    if torch.cuda.is_available():
        return False
    with _lock:
        if not is_active():
            _install_cpu_rng_tracker()
            CudaToCpuMode().__enter__()  # torch's mode stack holds it from now on
            _install_cuda_shims()  # last: it marks the backend active
    return True
