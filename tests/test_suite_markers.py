"""The suite's own honesty, read from its source (ast, no process): every test that starts torch.distributed
ranks carries the ``ranks`` marker (so ``-m "not ranks"`` leaves them all out), a missing ../shared path skips on
a developer's machine but fails under CI, and the run's closing lines group skips by reason and time by marker.
Each check has a control."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import run_summary
from tests.support.shared import need_import, need_shared, skip_or_fail
from tests.support.suite_markers import RANKS, SHARED, read_tests, unmarked

TESTS = Path(__file__).resolve().parent

LAUNCHING = {
    "tests.support.trainer": "def train(*a):\n    pass\n",
    "tests.support.ranks": "def launch(*a):\n    pass\n",
}


def _check(source: str, **others: str) -> list[str]:
    return unmarked({**LAUNCHING, **others, "tests.test_x": source}, RANKS)


def test_every_rank_launching_test_is_marked_ranks() -> None:
    sources, paths = read_tests(TESTS)
    assert len(sources) > 80  # the whole suite was read
    assert unmarked(sources, RANKS, paths) == []


def test_every_test_needing_shared_is_marked_shared() -> None:
    sources, paths = read_tests(TESTS)
    # this module's own need_shared test passes it paths of its own (tmp_path): it needs no ../shared
    own = "tests/test_suite_markers.py:"
    assert [line for line in unmarked(sources, SHARED, paths) if not line.startswith(own)] == []


def test_control_a_need_shared_without_the_marker_is_found() -> None:
    support = {"tests.support.shared": "def need_shared(*p, what):\n    pass\n"}
    conftest = (
        "import pytest\nfrom tests.support.shared import need_shared\n"
        "@pytest.fixture\ndef tokenizer():\n    need_shared('x', what='t')\n"
    )
    test = (
        "import pytest\n"
        "def test_a(tokenizer):\n    pass\n"
        "@pytest.mark.shared\ndef test_b(tokenizer):\n    pass\n"
        "def test_c(tmp_path):\n    pass\n"
    )
    sources = {**support, "tests.conftest": conftest, "tests.test_x": test}
    assert unmarked(sources, SHARED) == ["tests.test_x:2: test_a"]


def test_control_unmarked_launches_are_found() -> None:
    """Control: a launch reached directly, through a local helper, a fixture, another test module's helper, a
    torchrun command line or a fork-server context is found when the marker is missing."""
    direct = "from tests.support.trainer import train\ndef test_a():\n    train(['x'])\n"
    assert _check(direct) == ["tests.test_x:2: test_a"]
    helper = (
        "from tests.support.ranks import launch\n"
        "def _run():\n    return launch(2, [])\n"
        "def test_b():\n    _run()\n"
    )
    assert _check(helper) == ["tests.test_x:4: test_b"]
    fixture = (
        "import pytest\nfrom tests.support import trainer\n"
        "@pytest.fixture\ndef trained():\n    return trainer.train([])\n"
        "def test_c(trained):\n    assert trained\n"
        "def test_d(tmp_path):\n    assert tmp_path\n"
    )
    assert _check(fixture) == ["tests.test_x:6: test_c"]
    other_module = "from tests.test_y import _torchrun\ndef test_e():\n    _torchrun(2, [])\n"
    assert _check(other_module, **{"tests.test_y": "def _torchrun(n, a):\n    pass\n"}) == [
        "tests.test_x:2: test_e"
    ]
    command = "import subprocess, sys\ndef test_f():\n    subprocess.run([sys.executable, '-m', 'torch.distributed.run'])\n"
    assert _check(command) == ["tests.test_x:2: test_f"]
    server = "import multiprocessing\ndef test_g():\n    multiprocessing.get_context('forkserver')\n"
    assert _check(server) == ["tests.test_x:2: test_g"]
    cls = "from tests.support.trainer import train\nclass TestH:\n    def test_h(self):\n        train([])\n"
    assert _check(cls) == ["tests.test_x:3: TestH::test_h"]


def test_control_marked_launches_pass() -> None:
    """Control: the marker on the module, the test or its class satisfies the check; nothing launched, nothing
    asked."""
    body = "from tests.support.trainer import train\n"
    assert (
        _check(
            body
            + "import pytest\npytestmark = [pytest.mark.slow, pytest.mark.ranks]\ndef test_a():\n    train([])\n"
        )
        == []
    )
    assert _check(body + "import pytest\n@pytest.mark.ranks\ndef test_a():\n    train([])\n") == []
    assert (
        _check(
            body
            + "import pytest\n@pytest.mark.ranks\nclass TestA:\n    def test_a(self):\n        train([])\n"
        )
        == []
    )
    assert _check("def train(x):\n    pass\ndef test_a():\n    train(1)\n") == []  # a local `train`
    assert _check("def test_a():\n    print('torchrun is named in a sentence only')\n") == []


def _outcome(paths: list[Path], ci: str | None, monkeypatch: pytest.MonkeyPatch) -> str:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    try:
        need_shared(*paths, what="the test data")
    except pytest.skip.Exception as e:
        return f"skip: {e.msg}"
    except pytest.fail.Exception as e:
        return f"fail: {e.msg}"
    return "ran"


def test_need_shared_skips_locally_and_fails_under_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "shared" / "data" / "absent.json"
    assert _outcome([tmp_path, missing], None, monkeypatch) == (
        f"skip: needs ../shared (the test data): missing {missing}"
    )
    failed = _outcome([missing], "true", monkeypatch)
    assert (
        failed.startswith(f"fail: needs ../shared (the test data): missing {missing}") and "CI=true" in failed
    )
    assert _outcome([tmp_path], "true", monkeypatch) == "ran"  # control: present paths pass, also under CI
    assert _outcome([missing], "false", monkeypatch).startswith("skip: ")


def test_need_import_and_skip_or_fail_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert need_import("json", extra="test").dumps(1) == "1"  # control: present, imported
    with pytest.raises(pytest.fail.Exception, match="needs the ray extra"):
        need_import("mmpack_no_such_module", extra="ray")
    with pytest.raises(pytest.fail.Exception, match="cannot download"):
        skip_or_fail("cannot download the reference")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="needs the ray extra"):
        need_import("mmpack_no_such_module", extra="ray")


def test_skip_line_groups_reasons() -> None:
    reasons = [
        "needs ../shared (the Qwen3 tokenizer): missing /x/tokenizer.json",
        "needs ../shared (the video demo): missing /x/videos",
        "needs CUDA",
        "needs the energon extra (megatron.energon: No module named 'megatron.energon'); pip install ...",
    ]
    assert run_summary.skip_line(reasons) == (
        "skipped: 4 (needs ../shared: 2, needs CUDA: 1, needs the energon extra: 1)"
    )
    assert run_summary.skip_line([]) == "skipped: 0"
    report = SimpleNamespace(longrepr=("tests/x.py", 3, "Skipped: needs CUDA"))
    assert run_summary.skip_reason(report) == "needs CUDA"


def test_marker_time_line_counts_a_test_under_each_marker() -> None:
    reports = [
        SimpleNamespace(nodeid="a", when=when, duration=d) for when, d in [("setup", 1.0), ("call", 10.0)]
    ] + [
        SimpleNamespace(nodeid="b", when="call", duration=4.0),
        SimpleNamespace(nodeid="c", when="call", duration=2.0),
        SimpleNamespace(nodeid="c", when="teardown", duration=0.4),
        SimpleNamespace(nodeid="d", when="collect", duration=99.0),  # not a test phase
    ]
    durations = run_summary.durations_of(reports)
    assert durations == {"a": 11.0, "b": 4.0, "c": 2.4}
    tiers = {"a": ("ranks", "slow"), "b": ("ranks",), "c": ()}
    assert run_summary.marker_time_line(durations, tiers) == (
        "time by marker: ranks 15 s (2 tests), slow 11 s (1 test), unmarked 2 s (1 test); all 17 s (3 tests)"
    )


def test_file_time_line_sums_each_file_costliest_first() -> None:
    durations = {
        "tests/test_a.py::one": 3.0,
        "tests/test_b.py::one": 5.0,
        "tests/test_a.py::two[x]": 4.0,
        "tests/test_c.py::one": 1.0,
    }
    assert run_summary.file_time_line(durations, top=2) == (
        "time by file (top 2): test_a.py 7 s (2), test_b.py 5 s (1)"
    )
