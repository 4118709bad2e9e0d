"""`--engine ray` on a local 2-node Ray cluster (ray.cluster_utils.Cluster): the same shards, manifest, rejects
and stats as `--engine local`, byte for byte; also when a Ray worker process is killed in the middle of a
stage (Ray retries its task); reruns skip what is complete, as with the local engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mmpack.cli import main as mmpack_main
from mmpack.offline_packing.pipeline import run_pack
from tests.support.fixtures_data import (
    dataset_files,
    make_synthetic_dataset,
    small_job_config,
    train_tiny_bpe,
)
from tests.support.shared import need_import

ray = need_import("ray", extra="ray")
pytestmark = pytest.mark.slow  # a 2-node cluster takes ~10 s to start; the jobs themselves are small


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR")
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("raw")
    data = make_synthetic_dataset(root / "data", n_samples=60, seed=11, size_range=(40, 240), max_words=80)
    with data.jsonl_path.open("a") as f:  # rejects too: they must come out the same
        f.write('{"id": "bad", "image": "images/absent.jpg", "caption": "x"}\n{"not json\n')
    return data.jsonl_path, train_tiny_bpe(root / "tok")


_cfg = small_job_config


@pytest.fixture(scope="module")
def local_files(raw, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("local") / "out"
    run_pack(_cfg(raw, out, workers=2))
    return dataset_files(out)


def _assert_same(a: dict[str, bytes], b: dict[str, bytes]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name


def test_ray_equals_local(cluster, raw, local_files, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = run_pack(_cfg(raw, out, engine="ray"))
    assert summary.samples_rejected == 2 and summary.bins > 3
    got = dataset_files(out)
    assert any(n.endswith(".tar") for n in got) and "rejects.jsonl" in got
    _assert_same(local_files, got)
    import ray

    # the report names the cluster's own nodes and counts every task once (Ray's SPREAD is best effort: a
    # loaded machine may run a whole stage on one node, so how the tasks split is not asserted)
    per_node = summary.tasks_per_node
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert all(set(per_node[stage]) <= nodes and per_node[stage] for stage in ("scan", "lengths", "write")), (
        per_node
    )
    assert sum(per_node["write"].values()) == sum(n.endswith(".tar") for n in got), per_node
    # resume markers as with the local engine: a rerun skips every stage
    assert run_pack(_cfg(raw, out, engine="ray")).stages_skipped == ["scan", "lengths", "binpack", "write"]
    # control: another job (seed) differs, so the comparison can fail
    other = tmp_path / "other"
    run_pack(_cfg(raw, other, engine="ray", seed=7))
    with pytest.raises(AssertionError):
        _assert_same(local_files, dataset_files(other))


@pytest.mark.parametrize("stage", ["scan", "write"])
def test_killed_worker_is_retried(cluster, raw, local_files, tmp_path: Path, monkeypatch, stage: str) -> None:
    import mmpack.offline_packing.scan as scan_module
    import mmpack.offline_packing.write as write_module
    from tests.support.engine_tasks import killing_once

    marker = tmp_path / "killed.txt"
    module, name = (scan_module, "scan_chunk") if stage == "scan" else (write_module, "write_shard")
    monkeypatch.setattr(module, name, killing_once(str(marker), getattr(module, name)))
    out = tmp_path / "out"
    run_pack(_cfg(raw, out, engine="ray"))
    assert marker.is_file(), "no worker was killed: the test would show nothing"
    _assert_same(local_files, dataset_files(out))


def test_a_worker_keeps_its_context_for_the_stage(cluster) -> None:
    """Each worker process makes the context of its node once and keeps it for its later chunks (the tokenizer
    is loaded once per worker, not once per chunk); another stage starts from a new one."""
    from mmpack.offline_packing.context import JobContext
    from mmpack.offline_packing.engines.ray import run_ray
    from tests.support.engine_tasks import caches_seen

    ctx = JobContext(work_dir="unused", engine="ray")
    seen = run_ray(ctx, caches_seen, list(range(24)), desc="probe")
    by_pid: dict[int, set[int]] = {}
    for pid, caches, node in seen:
        by_pid.setdefault(pid, set()).add(caches)
        assert node and caches != id(ctx.caches)
    assert all(len(c) == 1 for c in by_pid.values()), by_pid
    assert len(seen) > len(by_pid)  # some worker ran several chunks (else the check shows nothing)
    again = {caches for _, caches, _ in run_ray(ctx, caches_seen, list(range(4)), desc="probe")}
    assert not again & {c for cs in by_pid.values() for c in cs}  # a new stage: new caches
    assert len(ctx.report.tasks_per_node["probe"]) >= 1


def test_rerun_redoes_only_missing_chunks(cluster, raw, local_files, tmp_path: Path) -> None:
    """As after a crash in the middle of lengths: the finished chunks are kept, only the missing one is redone."""
    out = tmp_path / "out"
    run_pack(_cfg(raw, out, engine="ray"))
    work = out / "_work"
    (work / "lengths.done.json").unlink()
    (work / "lengths" / "chunk-000002.done.json").unlink()
    kept = {
        p: p.stat().st_mtime_ns for p in (work / "lengths").glob("chunk-*.ids.npy") if "000002" not in p.name
    }
    summary = run_pack(_cfg(raw, out, engine="ray"))
    assert summary.stages_skipped == ["scan"]
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert (work / "lengths" / "chunk-000002.done.json").is_file()
    _assert_same(local_files, dataset_files(out))


def test_ray_workers_read_s3_inputs(cluster, raw, tmp_path: Path) -> None:
    """The job's storage options reach the Ray workers: records and images from S3, the same output as the
    local engine from the same URLs (records without an id are named after their source, so the URL run is
    compared with a URL run)."""
    from tests.support.storage_servers import moto_s3

    src, _ = raw
    with moto_s3() as endpoint:
        url = endpoint.upload_folder(src.parent, "raw", "ray")
        opts = endpoint.storage_options
        runs = {}
        for engine in ("local", "ray"):
            out = tmp_path / engine
            run_pack(_cfg(raw, out, engine=engine, inputs=(f"{url}/{src.name}",), storage_options=opts))
            runs[engine] = dataset_files(out)
    assert url.encode() in runs["ray"]["rejects.jsonl"]
    _assert_same(runs["local"], runs["ray"])


def test_work_folder_on_s3_without_a_shared_filesystem(cluster, raw, local_files, tmp_path: Path) -> None:
    """`-w s3://...`: each node works from its own cache of the URL (per node, so nothing passes through a
    shared local folder), and the output equals the local engine's with a local work folder."""
    from mmpack.offline_packing.workdir import cache_root
    from tests.support.storage_servers import moto_s3

    with moto_s3() as endpoint:
        fs = endpoint.make_bucket("work")
        out = tmp_path / "out"
        cfg = _cfg(raw, out, engine="ray", work_dir="s3://work/ray", storage_options=endpoint.storage_options)
        per_node = run_pack(cfg).tasks_per_node
        assert all(len(per_node[stage]) == 2 for stage in ("scan", "lengths", "write")), per_node
        keys = [k.removeprefix("work/ray/") for k in fs.find("work/ray")]
        assert "write.done.json" in keys and any(k.startswith("write/shard-") for k in keys)
        assert not (out / "_work").exists()
        caches = cache_root("s3://work/ray", "run").parent  # the driver's own went with the run
        nodes = {d.name.split("-", 1)[1] for d in caches.iterdir() if "-" in d.name}
        assert len(nodes) == 2, nodes  # each node fetched what it read into a cache of its own
        _assert_same(local_files, dataset_files(out))
        assert run_pack(cfg).stages_skipped == ["scan", "lengths", "binpack", "write"]


def test_cluster_has_two_nodes(cluster) -> None:
    """The cluster has two nodes with one CPU each, so a stage's tasks run on both."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 2
    assert sum(n["Resources"].get("CPU", 0) for n in alive) == 2


def test_engine_ray_without_ray_is_a_clear_error(raw, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    src, tok = raw
    code = mmpack_main(
        ["pack", "-i", str(src), "-o", str(tmp_path / "o"), "-L", "1024", "-t", str(tok), "--engine", "ray"]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "pip install -e .[ray]" in err and err.count("\n") == 1
