"""A process that dies mid-run ends its job within seconds, non-zero, with a line naming it: a checkpoint
writer, a loader worker and one of the four ranks of a TP2 x DP2 training run, one converter rank, one worker
of the offline job. The same runs without the kill finish normally (the controls). Within ``GONE_S`` of the
kill no process of the job is left (loader workers and checkpoint writers of a killed rank included: they
watch their parent). A collective waits at most ``--distributed-timeout-minutes``, then says so (gloo)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import leftovers, ranks
from tests.support.faults import STALL_WRITER_ENV
from tests.support.ranks import free_port
from tests.support.trainer import REPO, TINY

DEADLINE_S = 60  # from the kill to the job's exit
GONE_S = 30  # from the kill until no process of the job is left
TRAIN = [
    "--tensor-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--train-iters", "3", "--seed", "3",
]  # fmt: skip


@dataclass
class Launch:
    """A job started in the background (real torchrun, the converter), its output in files."""

    proc: subprocess.Popen
    folder: Path

    def text(self) -> str:
        return (self.folder / "stdout").read_text() + (self.folder / "stderr").read_text()

    def wait_until(self, ready: Any, what: str, timeout_s: float = 240) -> Any:
        """Polls ``ready()`` until it returns something true, which it returns."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            found = ready()
            if found:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended before {what}:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {timeout_s} s:\n{self.text()[-3000:]}")

    def finish(self, timeout_s: float = DEADLINE_S) -> tuple[int, float]:
        """(exit code, seconds it took to exit from now); kills the job when it overruns."""
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            self.proc.kill()
            raise AssertionError(
                f"still running {timeout_s} s after the kill:\n{self.text()[-3000:]}"
            ) from None
        return code, time.monotonic() - start


def start(args: list[str], folder: Path, env: dict[str, str] | None = None) -> Launch:
    folder.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        proc = subprocess.Popen(args, cwd=REPO, env=full_env, stdout=out, stderr=err)
    return Launch(proc, folder)


def training_argv(data: Path, folder: Path) -> list[str]:
    """TP2 x DP2 (4 ranks), 2 loader workers per reading rank, a checkpoint at the end."""
    return [
        "-m", "tests.support.faults", "trainer", *TINY, *TRAIN, "--data-path", str(data), "--num-workers", "2",
        "--save", str(folder / "ckpt"), "--metrics-file", str(folder / "metrics.jsonl"),
    ]  # fmt: skip


def start_training(data: Path, folder: Path) -> Launch:
    """The training run under real torchrun, in the background."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port"]
    return start([*torchrun, str(free_port()), *training_argv(data, folder)], folder)


def iterations_done(folder: Path) -> int:
    metrics = folder / "metrics.jsonl"
    return metrics.read_text().count('"loss"') if metrics.exists() else 0


@dataclass
class Killed:
    """A training run on warm ranks (``tests.support.ranks``) in which one process was killed."""

    launch: ranks.Launch
    pid: int  # the process killed
    took_s: float  # from the kill to the end of the group
    job: list[psutil.Process]  # the ranks and all their descendants just before the kill

    def text(self) -> str:
        return self.launch.stdout + self.launch.stderr


def assert_job_gone(job: list[psutil.Process], since_kill_s: float) -> None:
    """Every process of ``job`` ends within ``GONE_S`` of the kill (``since_kill_s`` ago); those left are
    named, then killed."""
    left = leftovers.still_running(job, max(GONE_S - since_kill_s, 3.0))  # those just signalled: to end
    leftovers.stop(left)
    assert not left, f"{GONE_S} s after the kill, still running: " + "; ".join(map(leftovers.describe, left))


def train_and_kill(
    data: Path, folder: Path, victim: Callable[[list[BaseProcess]], int], env: dict[str, str] | None = None
) -> Killed:
    """The training run on 4 warm ranks; ``victim(ranks)`` waits for the moment and returns the pid to kill.
    After the kill the group has ``DEADLINE_S`` to end; what still runs then is killed."""
    killed: list[tuple[int, float, list[psutil.Process]]] = []

    def kill_victim(procs: list[BaseProcess]) -> float:
        pid = victim(procs)
        job = leftovers.job_processes(p.pid for p in procs if p.pid is not None)
        kill(pid)
        killed.append((pid, time.monotonic(), job))
        return DEADLINE_S

    launch = ranks.launch(
        4, training_argv(data, folder), folder / "ranks", env=env, while_running=kill_victim
    )
    pid, at, job = killed[0]
    return Killed(launch, pid, time.monotonic() - at, job)


def wait_for(ready: Any, what: str, procs: list[BaseProcess], folder: Path, timeout_s: float = 240) -> Any:
    """Polls ``ready()`` until it returns something true, which it returns; fails when a rank ends first."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = ready()
        if found:
            return found
        if any(p.exitcode is not None for p in procs):
            raise AssertionError(f"a rank ended before {what}:\n{ranks_text(folder)[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s:\n{ranks_text(folder)[-3000:]}")


def ranks_text(folder: Path) -> str:
    return "".join(path.read_text(errors="replace") for path in sorted((folder / "ranks").glob("rank*.*")))


def rank_process(launch: Launch, rank: int) -> psutil.Process:
    """The training process of global rank ``rank`` (a child of torchrun with RANK in its environment)."""
    for child in psutil.Process(launch.proc.pid).children():
        if child.environ().get("RANK") == str(rank):
            return child
    raise AssertionError(f"no process of rank {rank}")


def stalled_writer(folder: Path, settle_s: float = 0.0) -> int | None:
    """The pid of a checkpoint writer stopped by tests.support.faults, once there is one: of those there ``settle_s``
    seconds later, the one forked last (the highest bucket index; pids wrap, so not the highest pid). Its death
    is the one a pipe end inherited by the writers forked before it would hide."""
    if not any(folder.glob("writer-*")):
        return None
    time.sleep(settle_s)
    found = {}
    for path in folder.glob("writer-*"):
        with contextlib.suppress(ValueError, IndexError):  # a file still being written
            found[int(path.read_text().split()[1])] = int(path.name.split("-")[1])
    return found[max(found)] if found else None


def writer_parent(folder: Path, writer: int) -> int:
    """The pid of the rank that forked a stalled writer."""
    return int((folder / f"writer-{writer}").read_text().split()[0])


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def kill_stalled_writers(folder: Path) -> None:
    """Writers tests.support.faults holds that outlived their rank (they would sleep on for two minutes)."""
    for path in folder.glob("writer-*"):
        with contextlib.suppress(ProcessLookupError):
            kill(int(path.name.split("-")[1]))


@pytest.fixture(scope="module")
def data(packed_dataset: Callable[..., Path]) -> Path:
    return packed_dataset(n_samples=40, seed=5)


@pytest.mark.ranks
@pytest.mark.slow
def test_control_training_run_finishes(data: Path, tmp_path: Path) -> None:
    run = ranks.launch(4, training_argv(data, tmp_path), tmp_path / "ranks", timeout_s=420)
    assert run.returncode == 0 and not run.timed_out, run.report()
    assert iterations_done(tmp_path) == 3
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"


@pytest.mark.ranks
@pytest.mark.slow
def test_killed_training_rank_ends_the_job(data: Path, tmp_path: Path) -> None:
    """Under real torchrun, not warm ranks: what is tested is torchrun's own report of the killed worker (its
    local rank, pid and ``exitcode: -9``) and torchrun's ending of the job (the warm ranks' launcher has its
    own report and its own stopping of the group, tested in tests/test_rank_launcher.py)."""
    run = start_training(data, tmp_path)
    run.wait_until(lambda: iterations_done(tmp_path) >= 1, "iteration 1")
    victim = rank_process(run, 2)
    workers = victim.children()  # its loader workers: they end with it, though nothing stops them
    assert len(workers) == 2, [p.cmdline() for p in workers]
    job = leftovers.job_processes([run.proc.pid])  # torchrun, its ranks and theirs
    kill(victim.pid)
    code, took_s = run.finish()
    assert_job_gone(job, since_kill_s=took_s)
    text = run.text()
    assert code != 0 and took_s < DEADLINE_S
    assert f"local_rank: 2 (pid: {victim.pid})" in text and "exitcode: -9" in text  # torchrun names it
    assert "faults.py" not in text  # no rank's traceback: a rank that saw it go says so in one line


@pytest.mark.ranks
@pytest.mark.slow
def test_killed_loader_worker_ends_the_job(data: Path, tmp_path: Path) -> None:
    def second_worker_of_rank_2(procs: list[BaseProcess]) -> int:
        wait_for(lambda: iterations_done(tmp_path) >= 1, "iteration 1", procs, tmp_path)
        # TP rank 0 of DP rank 1: it reads, its TP peer gets the batches
        reader = psutil.Process(procs[2].pid)
        workers = [p for p in reader.children() if p.cmdline() == reader.cmdline()]  # forked: same command
        assert len(workers) == 2, [p.cmdline() for p in reader.children()]
        return workers[1].pid

    run = train_and_kill(data, tmp_path, second_worker_of_rank_2)
    assert run.launch.returncode != 0 and run.took_s < DEADLINE_S, run.launch.report()
    assert_job_gone(run.job, since_kill_s=run.took_s)
    lines = [line for line in run.text().splitlines() if line.startswith("pretrain_vlm: error: rank 2:")]
    assert len(lines) == 1, run.launch.report()
    assert "loader worker mmpack-loader-" in lines[0] and f"(pid {run.pid}) was killed by SIGKILL" in lines[0]


@pytest.mark.ranks
@pytest.mark.slow
def test_killed_checkpoint_writer_ends_the_job(data: Path, tmp_path: Path) -> None:
    def writer_of_rank_1(procs: list[BaseProcess]) -> int:
        stalled = lambda: stalled_writer(tmp_path, settle_s=2.0)  # noqa: E731
        return int(wait_for(stalled, "a checkpoint writer of rank 1", procs, tmp_path))

    try:
        run = train_and_kill(data, tmp_path, writer_of_rank_1, env={STALL_WRITER_ENV: f"{tmp_path}:1"})
        assert_job_gone(run.job, since_kill_s=run.took_s)  # the other stalled writers of rank 1 too
    finally:
        kill_stalled_writers(tmp_path)
    writer = run.pid
    assert run.launch.returncode != 0 and run.took_s < DEADLINE_S, run.launch.report()
    lines = [line for line in run.text().splitlines() if line.startswith("pretrain_vlm: error: rank 1:")]
    assert len(lines) == 1, run.launch.report()
    assert (
        f"checkpoint writer process {writer} of rank 1 (writing {tmp_path}/ckpt/iter_0000003.tmp/" in lines[0]
    )
    assert lines[0].endswith("was killed by SIGKILL before it finished")
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()  # never recorded


@pytest.mark.ranks
@pytest.mark.slow
def test_killed_converter_rank_ends_the_job_and_the_same_run_finishes(data: Path, tmp_path: Path) -> None:
    """hf-to-mcore at TP2: rank 1 killed while its checkpoint writer is held; the control converts."""
    from tests.support.qwen2_5_vl import hf_model_for

    hf = hf_model_for(data, tmp_path / "hf", tied=False)

    def convert(out: str, env: dict[str, str] | None = None) -> Launch:
        cmd = [
            sys.executable,
            "-m",
            "tests.support.faults",
            "mmpack",
            "convert",
            "hf-to-mcore",
            "--hf",
            str(hf),
        ]
        return start([*cmd, "--out", str(tmp_path / out), "--tp", "2"], tmp_path / f"run-{out}", env)

    control = convert("control")
    code, _ = control.finish(timeout_s=300)
    assert code == 0, control.text()[-3000:]
    assert (tmp_path / "control" / "iter_0000000" / "metadata.json").is_file()

    stalls = tmp_path / "stalls"
    stalls.mkdir()
    run = convert("killed", env={STALL_WRITER_ENV: f"{stalls}:1"})
    try:
        writer = run.wait_until(lambda: stalled_writer(stalls), "a checkpoint writer of converter rank 1")
        rank_1 = writer_parent(stalls, writer)  # the converter rank
        job = leftovers.job_processes([run.proc.pid])
        kill(rank_1)
        code, took_s = run.finish()
        assert_job_gone(job, since_kill_s=took_s)  # the stalled writer of rank 1 too
    finally:
        kill_stalled_writers(stalls)
    assert code == 1 and took_s < DEADLINE_S
    errors = [line for line in run.text().splitlines() if line.startswith("mmpack convert: error:")]
    assert errors == [
        f"mmpack convert: error: converter process {rank_1} (rank 1 of 2) was killed by SIGKILL; the other "
        "ranks were stopped and the output is incomplete"
    ], run.text()[-3000:]


def _timeout_rank(rank: int, port: int, results: Any) -> None:
    """One of two ranks set up as the trainer does, with a 3 s timeout; rank 1 never joins the collective."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mmpack.trainer import cpu_backend
    from mmpack.trainer.config import ParallelConfig, RunConfig
    from mmpack.trainer.failures import describe_failure
    from mmpack.trainer.training import initialize_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    minutes = 0.05
    cpu_backend.activate()  # the test is the entry point: it sets up the CPU backend (no CUDA)
    initialize_distributed(RunConfig(parallel=ParallelConfig(distributed_timeout_minutes=minutes)))
    if rank == 1:
        time.sleep(15)  # stuck: the other rank's collective must give up first
        return
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=ps.get_data_parallel_group())  # one of megatron-core's groups
    except RuntimeError as e:
        results.put((time.monotonic() - start, describe_failure(e, timeout_minutes=minutes)))
        results.put(describe_failure(ValueError("a bug"), timeout_minutes=minutes))  # other errors: None
        return
    results.put((time.monotonic() - start, "no error"))


@pytest.mark.ranks
@pytest.mark.slow
def test_collective_times_out_with_a_message_naming_the_flag() -> None:
    ctx = ranks.context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_timeout_rank, args=(rank, port, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        took_s, line = results.get(timeout=120)
        other = results.get(timeout=10)
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert line is not None and line.startswith(
        "a collective did not complete within --distributed-timeout-minutes 0.05: another rank is stuck or gone"
    ), line
    assert "Timed out" in line and 2.5 < took_s < 30  # gloo's own words; it waited the 3 s, not forever
    assert other is None  # an error of another kind keeps its traceback


def _run_or_die(ctx: object, x: int) -> int:
    if x == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
    return 2 * x


def test_killed_offline_worker_ends_the_stage_and_the_same_run_finishes() -> None:
    from mmpack.offline_packing.context import JobContext
    from mmpack.offline_packing.engines import run_parallel
    from mmpack.packing.processes import ProcessDiedError

    ctx = JobContext(work_dir="unused")
    assert run_parallel(ctx, _run_or_die, [0, 1, 2, 3], workers=2, desc="scan", progress=False) == [
        0,
        2,
        4,
        6,
    ]
    start = time.monotonic()
    with pytest.raises(
        ProcessDiedError,
        match=r"^scan: a worker process of the local engine died \(mmpack-pack-\d was killed by SIGKILL\) "
        r"before chunk \d of 8",
    ):
        run_parallel(ctx, _run_or_die, list(range(8)), workers=2, desc="scan", progress=False)
    assert time.monotonic() - start < DEADLINE_S
