"""The CPU backend adapts megatron-core's CUDA assumptions only when CUDA is absent.

Each case runs in a fresh interpreter: activation is process-global by design.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_inactive_when_cuda_present() -> None:
    out = _run(
        """
        import torch
        torch.cuda.is_available = lambda: True
        original = torch.cuda.current_device
        from mmpack.trainer import cpu_backend
        assert cpu_backend.activate() is False
        assert not cpu_backend.is_active() and cpu_backend.require_backend("x") is False
        assert torch.cuda.current_device is original
        from torch.overrides import _get_current_function_mode_stack
        assert not any(isinstance(m, cpu_backend.CudaToCpuMode) for m in _get_current_function_mode_stack())
        print("inactive")
        """
    )
    assert out.strip() == "inactive"


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the CPU backend only activates without CUDA"
)
def test_active_without_cuda_maps_cuda_to_cpu() -> None:
    out = _run(
        """
        import torch
        from mmpack.trainer import cpu_backend
        try:  # library code asks; before the entry point set the backend up, it says so
            cpu_backend.require_backend("the trainer")
        except RuntimeError as e:
            assert str(e).startswith("the trainer: no CUDA here and the CPU backend is not set up"), e
        else:
            raise AssertionError("require_backend passed without CUDA or the CPU backend")
        assert not cpu_backend.is_active()  # asking changed nothing
        assert cpu_backend.activate() is True and cpu_backend.activate() is True  # idempotent
        assert cpu_backend.require_backend("the trainer") is True
        assert torch.empty(3, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.tensor([1.0], device="cuda:0").device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t and t.to("cuda").device.type == "cpu"
        assert t.to(torch.float16).dtype == torch.float16
        assert t.type() == "torch.cuda.FloatTensor"  # what megatron's optimizers check for
        torch.cuda.synchronize()
        print("ok")
        """
    )
    assert out.strip() == "ok"


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the CPU backend only activates without CUDA"
)
def test_model_parallel_rng_tracker_uses_cpu_generator() -> None:
    out = _run(
        """
        import torch
        from mmpack.trainer import cpu_backend
        cpu_backend.activate()
        from megatron.core import tensor_parallel
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 1234)
        torch.manual_seed(7)
        outside_before = torch.rand(2)
        torch.manual_seed(7)
        with tracker.fork():
            a = torch.rand(3)
        outside_after = torch.rand(2)
        assert torch.equal(outside_before, outside_after), "fork must restore the default generator"
        with tracker.fork():
            b = torch.rand(3)
        assert not torch.equal(a, b), "the tracked stream advances"
        tracker.reset(); tracker.add("model-parallel-rng", 1234)
        with tracker.fork():
            c = torch.rand(3)
        assert torch.equal(a, c), "same seed, same stream"
        print("ok")
        """
    )
    assert out.strip() == "ok"
