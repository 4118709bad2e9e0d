"""`--data-path s3://...`: training streams the packed dataset from an S3 endpoint (moto, on 127.0.0.1) and
sees exactly the data and losses of the same dataset read from local disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainer import make_packed_dataset, train

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

ARGS = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--seed", "4"]


def test_training_from_s3_matches_local(tmp_path: Path) -> None:
    from tests.support.storage_servers import moto_s3

    data = make_packed_dataset(tmp_path / "data", n_samples=80, seed=3)
    local = train(2, ["--data-path", str(data), *ARGS], tmp_path / "local")
    assert local.returncode == 0, local.stderr[-4000:]
    with moto_s3() as s3:
        url = s3.upload_folder(data, "mmpack-test", "packed")
        env = {
            "AWS_ENDPOINT_URL": s3.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        remote = train(2, ["--data-path", url, *ARGS], tmp_path / "s3", env=env)
    assert remote.returncode == 0, remote.stderr[-4000:]
    assert f"data {url}" in remote.stdout
    assert [m["data_digest"] for m in remote.train] == [m["data_digest"] for m in local.train]
    assert remote.losses() == local.losses()
