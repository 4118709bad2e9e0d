"""Exiting early, without processes: SIGTERM / SIGUSR1 are recorded (not fatal) while the recorder is
installed and the previous handlers come back after; the exit policy's reasons (signal, duration, interval)
and the flags' checks. The ranks' agreement and the saved checkpoint are tests/test_trainer_parallel.py's
(one rank of eight signalled)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mmpack.trainer.arguments import parse_args
from mmpack.trainer.exits import ExitConfig, ExitPolicy, ExitSignals


def _wait_for(signals: ExitSignals, signum: int) -> None:
    deadline = time.monotonic() + 5
    while signals.received != signum and time.monotonic() < deadline:
        time.sleep(0.01)


def test_signals_are_recorded_then_handlers_restored() -> None:
    seen: list[int] = []
    term_before = signal.getsignal(signal.SIGTERM)  # whatever the test runner installed
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with ExitSignals() as signals:
            assert signals.received == 0
            os.kill(os.getpid(), signal.SIGUSR1)
            _wait_for(signals, signal.SIGUSR1)
            assert signals.received == signal.SIGUSR1
            os.kill(os.getpid(), signal.SIGTERM)  # would end this process without the recorder
            _wait_for(signals, signal.SIGTERM)
            assert signals.received == signal.SIGTERM
            assert seen == []  # the recorder, not the previous handler, took them
        os.kill(os.getpid(), signal.SIGUSR1)  # control: the previous handler is back
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGTERM) == term_before
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_policy_reasons() -> None:
    duration = ExitPolicy(ExitConfig(exit_duration_in_mins=1.5), None, start_s=1000.0)
    assert duration.reason(7, now_s=1000.0 + 89) is None
    assert duration.reason(7, now_s=1000.0 + 91) == "--exit-duration-in-mins 1.5 reached"

    interval = ExitPolicy(ExitConfig(exit_interval=3), None, start_s=0.0)
    assert [interval.reason(i) for i in (1, 2, 4, 5)] == [None] * 4
    assert interval.reason(6) == "--exit-interval 3 reached"

    signals = ExitSignals()
    both = ExitPolicy(ExitConfig(exit_signal_handler=True, exit_duration_in_mins=1), signals, start_s=0.0)
    assert both.reason(1, now_s=30.0) is None
    signals.received = signal.SIGUSR1
    assert both.reason(1, now_s=90.0) == "received SIGUSR1"  # a signal outranks the clock


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--exit-signal-handler"],
            "--exit-signal-handler saves a checkpoint before it exits: add --save DIR",
        ),
        (["--exit-interval", "0"], "--exit-interval must be >= 1, got 0"),
        (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0, got 0.0"),
    ],
)
def test_bad_exit_flags_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("+", r"\+") + "$"):
        parse_args(["--mock-data", *flags])


def test_exit_flags_parse() -> None:
    cfg = parse_args(["--mock-data", "--exit-signal-handler", "--save", "x", "--exit-interval", "5",
                      "--exit-duration-in-mins", "230"])  # fmt: skip
    assert cfg.exit == ExitConfig(exit_signal_handler=True, exit_interval=5, exit_duration_in_mins=230.0)
    assert not parse_args(["--mock-data"]).checkpoint.no_verify_checkpoint
    assert parse_args(
        ["--mock-data", "--load", "x", "--no-verify-checkpoint"]
    ).checkpoint.no_verify_checkpoint
