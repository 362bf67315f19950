"""Shared test set-up: 8 host CPU devices for JAX meshes (set before jax is imported); a moto S3 server."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from spawn import free_port

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture()
def every_checkpoint_validates(tmp_path):
    """After the test: ``xckpt validate --deep`` passes on every xckpt checkpoint it wrote under tmp_path."""
    yield
    import xckpt

    for path in sorted(p.parent for p in tmp_path.rglob("xckpt.json")):
        report = xckpt.validate(path, deep=True)
        assert report.ok, (str(path), [str(f) for f in report.findings])


@pytest.fixture(scope="session")
def moto():
    """A moto S3 server on a free loopback port; TensorStore's s3 driver points at it through the AWS variables."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": endpoint}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        deadline = time.monotonic() + 30
        while True:
            try:
                client.list_buckets()
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        yield SimpleNamespace(client=client, port=port, endpoint=endpoint)
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
