"""Leaving a run early at a step boundary, as Megatron-LM does: on SIGTERM or SIGUSR1
(``--exit-signal-handler``, what cluster schedulers send before preemption), after ``--exit-duration-in-mins``
of wall time, or at every ``--exit-interval`` iterations. The trainer finishes the step it is in, saves a
checkpoint of it and exits 0.

A signal reaches the ranks at different moments (or only some of them), so the decision is taken together:
after every step the ranks all-reduce (MAX) what each has seen, and either all of them stop at that step or
none does.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from mmpack.trainer.flags import flag

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass(kw_only=True, frozen=True)
class ExitConfig:
    """When a run stops before ``--train-iters`` (each saves a checkpoint of its last step when ``--save``
    is given)."""

    exit_signal_handler: bool = flag(
        False,
        help="on SIGTERM or SIGUSR1 finish the current step, save a checkpoint of it on every rank and exit 0",
    )
    exit_duration_in_mins: float | None = flag(
        None, help="exit after this many minutes of wall time (checked after every step)"
    )
    exit_interval: int | None = flag(None, help="exit at the first multiple of N iterations")

    def __post_init__(self) -> None:
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise ValueError(f"--exit-duration-in-mins must be > 0, got {self.exit_duration_in_mins}")
        if self.exit_interval is not None and self.exit_interval < 1:
            raise ValueError(f"--exit-interval must be >= 1, got {self.exit_interval}")

    @property
    def needs_agreement(self) -> bool:
        """Whether the ranks must compare notes after each step (signals and clocks differ between ranks;
        the exit interval is the same iteration everywhere)."""
        return self.exit_signal_handler or self.exit_duration_in_mins is not None


class ExitSignals:
    """Records SIGTERM / SIGUSR1 instead of dying of them, while installed (a context manager); the
    previous handlers come back on exit. Processes forked meanwhile (loader workers, the async checkpoint
    writer) inherit the handler, so they too live on until the trainer stops them."""

    def __init__(self) -> None:
        self.received: int = 0  # the last signal number received, 0 for none
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def __enter__(self) -> ExitSignals:
        for sig in EXIT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


# the reasons, by priority in the all-reduce (MAX): a signal outranks the clock
_NONE, _DURATION = 0, 1


class ExitPolicy:
    """Decides after each step whether the run stops there, the same way on every rank."""

    def __init__(self, cfg: ExitConfig, signals: ExitSignals | None, *, start_s: float) -> None:
        self.cfg = cfg
        self.signals = signals
        self.start_s = start_s

    def _local_code(self, now_s: float) -> int:
        """What this rank has seen: a signal number (>= 2), _DURATION or _NONE."""
        if self.signals is not None and self.signals.received:
            return self.signals.received
        limit = self.cfg.exit_duration_in_mins
        if limit is not None and (now_s - self.start_s) / 60.0 > limit:
            return _DURATION
        return _NONE

    def reason(self, iteration: int, *, now_s: float | None = None) -> str | None:
        """Why the run stops after ``iteration`` (None: it goes on). Collective when signals or a duration
        are watched."""
        code = _NONE
        if self.cfg.needs_agreement:
            code = _agree_max(self._local_code(time.time() if now_s is None else now_s))
        if code >= 2:
            return f"received {signal.Signals(code).name}"
        if code == _DURATION:
            return f"--exit-duration-in-mins {self.cfg.exit_duration_in_mins:g} reached"
        interval = self.cfg.exit_interval
        if interval and iteration % interval == 0:
            return f"--exit-interval {interval} reached"
        return None


def _agree_max(code: int) -> int:
    """The largest ``code`` over all ranks (the code itself without a process group)."""
    if not dist.is_initialized():
        return code
    device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces CUDA tensors only
    t = torch.tensor([code], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
