"""The tests' rank launcher (tests/support/ranks.py), with tiny worker scripts and no training: each rank gets
torchrun's environment and a working gloo group; its exit code and output come back; a rank that dies while
the others wait in a collective ends the group (no hang), a group that hangs is killed at its deadline; and a
trainer rank killed mid-run ends the training group and leaves no process of it behind."""

from __future__ import annotations

import json
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import leftovers, ranks
from tests.support.trainer import Signal, train

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

# the end of a group once one rank failed: the others' grace, SIGTERM, then SIGKILL, plus some slack
STOP_S = ranks.FAIL_GRACE_S + ranks.TERM_GRACE_S + 5


def _script(folder: Path, body: str) -> Path:
    """A worker script in ``folder``: ``body`` after gloo set up from torchrun's environment."""
    path = folder / "worker.py"
    head = """\
        import json, os, sys, time
        from datetime import timedelta
        from pathlib import Path

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        rank = dist.get_rank()
        """
    path.write_text(textwrap.dedent(head) + textwrap.dedent(body))
    return path


def test_ranks_get_torchruns_environment_and_a_gloo_group(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """\
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EXTRA")
        record = {"env": {k: os.environ.get(k) for k in keys}, "sum": float(total), "argv": sys.argv[1:],
                  "cwd": os.getcwd(), "dist": [dist.get_rank(), dist.get_world_size()]}
        Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(record))
        dist.destroy_process_group()
        """,
    )
    run = ranks.launch(
        3, [str(script), str(tmp_path), "more"], tmp_path / "ranks", cwd=tmp_path, env={"EXTRA": "x"}
    )
    ranks.checked(run)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    ports = {rec["env"]["MASTER_PORT"] for rec in records}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, rec in enumerate(records):
        assert rec["env"] | {"MASTER_PORT": None} == {
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": None, "EXTRA": "x",
        }, rec  # fmt: skip
        assert rec["dist"] == [r, 3] and rec["sum"] == 1 + 2 + 3  # one gloo group over the three ranks
        assert rec["argv"] == [str(tmp_path), "more"] and rec["cwd"] == str(tmp_path)
    assert [r.exitcode for r in run.ranks] == [0, 0, 0] and run.failed_first is None


def test_exit_codes_and_output_come_back(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """\
        print(f"out of rank {rank}")
        print(f"err of rank {rank}", file=sys.stderr)
        dist.barrier()
        dist.destroy_process_group()
        if rank == 1:
            sys.exit(3)
        if rank == 2:
            raise ValueError("a bug in rank 2")
        """,
    )
    run = ranks.launch(3, [str(script)], tmp_path / "ranks", timeout_s=120)
    assert not run.timed_out and run.seconds < 120, run.report()
    assert [r.exitcode for r in run.ranks] == [0, 3, 1], run.report()
    assert run.returncode in (3, 1) and run.failed_first in (1, 2)  # whichever of the two failed first
    for r in run.ranks:
        assert f"out of rank {r.rank}\n" == r.stdout
        assert r.stderr.startswith(f"err of rank {r.rank}\n")
    assert run.ranks[2].stderr.rstrip().endswith("ValueError: a bug in rank 2")  # its traceback
    assert "Traceback" not in run.ranks[1].stderr  # sys.exit(3): a plain exit
    assert (tmp_path / "ranks" / "rank1.out").read_text() == "out of rank 1\n"
    report = run.report()
    assert "-- rank 1: exit 3" in report and "-- rank 2: exit 1" in report and "-- rank 0: exit 0" in report


def test_a_rank_killed_during_a_collective_ends_the_group(tmp_path: Path) -> None:
    """Rank 1 kills itself (SIGKILL) while rank 0 waits for it in an all_reduce (gloo would wait 10 minutes)
    and rank 2 sleeps (it would never notice): the group ends within seconds, far before its deadline, and the
    report names every rank's exit."""
    script = _script(
        tmp_path,
        """\
        dist.barrier()
        if rank == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), 9)
        if rank == 2:
            print("sleeping", flush=True)
            time.sleep(600)
        print("waiting in all_reduce", flush=True)
        dist.all_reduce(torch.ones(1))
        print("all_reduce returned", flush=True)
        """,
    )
    timeout_s = 120
    run = ranks.launch(3, [str(script)], tmp_path / "ranks", timeout_s=timeout_s)
    assert not run.timed_out and run.seconds < STOP_S, run.report()  # no hang: far from the deadline
    assert run.ranks[1].exitcode == -signal.SIGKILL and run.failed_first == 1, run.report()
    assert run.returncode == -signal.SIGKILL
    code_0 = run.ranks[0].exitcode
    assert code_0 not in (0, None), run.report()  # gloo's error, or stopped by the launcher
    assert run.ranks[2].exitcode == -signal.SIGTERM, run.report()  # stopped by the launcher
    assert "waiting in all_reduce" in run.ranks[0].stdout and "all_reduce returned" not in run.stdout
    assert run.ranks[2].stdout == "sleeping\n"
    report = run.report()
    for r in run.ranks:
        assert f"-- rank {r.rank}: exit {r.exitcode}\n" in report, report


def test_a_hanging_group_is_killed_at_its_deadline(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """\
        dist.barrier()
        print("hanging", flush=True)
        time.sleep(600)
        """,
    )
    timeout_s = 12  # the ranks are up and hanging within a few seconds, even on a loaded machine
    run = ranks.launch(2, [str(script)], tmp_path / "ranks", timeout_s=timeout_s)
    assert run.timed_out, run.report()
    assert timeout_s <= run.seconds < timeout_s + 5, run.report()  # killed at the deadline, not later
    assert [r.exitcode for r in run.ranks] == [-signal.SIGKILL] * 2, run.report()
    assert [r.stdout for r in run.ranks] == ["hanging\n"] * 2  # both were up and hanging
    assert run.returncode != 0
    with pytest.raises(AssertionError, match="killed at the deadline"):
        ranks.checked(run)


def test_a_trainer_rank_killed_mid_run_ends_the_group(
    tmp_path: Path, packed_dataset: Callable[..., Path]
) -> None:
    """A DP2 training run far too long to finish within its deadline, two loader workers per rank; rank 1
    killed (SIGKILL) after its first step: the other rank stops, the group ends before the deadline, and
    within 30 s of that nothing the run started is left (the killed rank's loader workers end with it)."""
    timeout_s = 240
    data = packed_dataset(n_samples=40, seed=5)
    args = ["--data-path", str(data), "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "100000", "--log-interval", "1", "--num-workers", "2"]  # fmt: skip
    send = Signal(signal.SIGKILL, rank=1, after_iteration=1)
    run = train(2, args, tmp_path, timeout_s=timeout_s, send=send)
    assert run.launch is not None
    left = leftovers.leftover_processes(keep=ranks.fork_server_pids(), grace_s=30)
    leftovers.stop(left)
    assert not left, "still running: " + "; ".join(map(leftovers.describe, left))
    launch = run.launch
    assert not launch.timed_out and launch.seconds < timeout_s, launch.report()
    assert launch.ranks[1].exitcode == -signal.SIGKILL and launch.failed_first == 1, launch.report()
    assert launch.ranks[0].exitcode not in (0, None), launch.report()
    assert 1 <= len(run.train) < 100000
    report = launch.report()
    assert f"-- rank 0: exit {launch.ranks[0].exitcode}" in report and "-- rank 1: exit -9" in report
