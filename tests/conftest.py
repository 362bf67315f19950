"""Shared test set-up: 8 host CPU devices for JAX meshes (set before jax is imported)."""

import os

import pytest

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
