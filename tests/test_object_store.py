"""Checkpoints on an S3-compatible object store: a real moto server on loopback, TensorStore's s3 driver."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Any

import numpy as np
import pytest

import xckpt
from xckpt.errors import SaveError
from xckpt.format.regions import Region
from xckpt.registry import ArraySource, Shard
from xckpt.validate import Report

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3_bucket(moto):
    """The bucket ``ckpts`` on the session's moto server (tests/conftest.py); its boto3 client."""
    moto.client.create_bucket(Bucket="ckpts")
    return moto.client


def _keys(client, prefix: str) -> list[str]:
    out = client.list_objects_v2(Bucket="ckpts", Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


def test_save_load_validate_on_s3(s3_bucket):
    url = f"s3://ckpts/run-{uuid.uuid4().hex[:6]}/step_10"
    w = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    xckpt.save({"params": {"w": w}, "step": 10, "name": "run"}, url, inner_chunk_bytes=256)
    prefix = url[len("s3://ckpts/"):] + "/"
    keys = _keys(s3_bucket, prefix)
    assert prefix + "xckpt.json" in keys and prefix + "commit_success.txt" in keys
    assert prefix + "params.w/zarr.json" in keys
    out = xckpt.load(url)
    np.testing.assert_array_equal(out["params"]["w"], w)
    assert out["step"] == 10 and out["name"] == "run"
    part = xckpt.load(url, like={"params": {"w": xckpt.ReadSpec(region=(slice(5, 9), slice(0, 16)))}})
    np.testing.assert_array_equal(part["params"]["w"], w[5:9])
    report = xckpt.validate(url, deep=True)
    assert report.ok, [str(f) for f in report.findings]
    assert report.bytes_checked >= w.nbytes
    assert xckpt.inspect(url)["total_bytes"] == w.nbytes
    with pytest.raises(SaveError) as info:  # no in-place replacement on an object store
        xckpt.save({"x": np.ones(2)}, url, overwrite=True)
    assert info.value.code == "save.exists"
    np.testing.assert_array_equal(xckpt.load(url)["params"]["w"], w)


def test_failed_save_on_s3_commits_nothing(s3_bucket):
    url = f"s3://ckpts/run-{uuid.uuid4().hex[:6]}/step_1"

    def boom() -> np.ndarray:
        raise RuntimeError("device lost")

    bad = ArraySource((4,), "float32", [Shard(Region((0,), (4,)), boom)])
    with pytest.raises(SaveError, match="device lost"):
        xckpt.save({"ok": np.ones(1000, np.float32), "bad": bad}, url)
    assert _keys(s3_bucket, url[len("s3://ckpts/"):]) == []
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.load(url)
    assert info.value.code == "manifest.missing"
    xckpt.save({"ok": np.ones(3)}, url)  # the prefix is usable afterwards
    np.testing.assert_array_equal(xckpt.load(url)["ok"], np.ones(3))


def test_corruption_on_s3_is_detected(s3_bucket):
    url = f"s3://ckpts/run-{uuid.uuid4().hex[:6]}/c"
    xckpt.save({"w": np.arange(64, dtype=np.float32)}, url)
    key = url[len("s3://ckpts/"):] + "/w/c/0"
    body = bytearray(s3_bucket.get_object(Bucket="ckpts", Key=key)["Body"].read())
    body[1] ^= 0xFF
    s3_bucket.put_object(Bucket="ckpts", Key=key, Body=bytes(body))
    codes = xckpt.validate(url, deep=True).codes()
    assert codes == ["chunk.crc32c"]
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.load(url)
    assert info.value.code == "chunk.crc32c" and info.value.leaf == "w"


def test_several_writers_on_s3(s3_bucket):
    """Four ranks (our thread coordinator) each write their shard of one array to the same prefix."""
    from threaded import run_ranks

    url = f"s3://ckpts/run-{uuid.uuid4().hex[:6]}/multi"
    full = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)

    def body(coord):
        r = Region((coord.rank * 10, 0), (10, 8))
        src = ArraySource(full.shape, "float32", [Shard(r, lambda: full[r.slices()])])
        return xckpt.save({"w": src, "step": 5}, url, coordinator=coord)

    run_ranks(4, body)
    prefix = url[len("s3://ckpts/"):] + "/w/c/"
    assert _keys(s3_bucket, prefix) == [prefix + f"{i}/0" for i in range(4)]
    np.testing.assert_array_equal(xckpt.load(url)["w"], full)
    assert xckpt.validate(url, deep=True).ok


def _first_finding(report: Report) -> dict[str, Any] | None:
    """The first finding of a validation report, as a dict (None: valid)."""
    return None if report.ok else dataclasses.asdict(report.findings[0])


def _errors_of(url: str) -> dict[str, BaseException | None]:
    """What save, load, deep validation and gc of ``url`` raise (None: nothing)."""
    out: dict[str, BaseException | None] = {}
    for what, fn in [("save", lambda: xckpt.save({"w": np.arange(4.0)}, url + "-new")),
                     ("load", lambda: xckpt.load(url)), ("gc", lambda: xckpt.gc(url)),
                     ("validate", lambda: _first_finding(xckpt.validate(url, deep=True)))]:
        try:
            got = fn()
        except Exception as exc:  # noqa: BLE001 - compared below
            out[what] = exc
        else:
            out[what] = got if isinstance(got, dict) else None
    return out


def test_missing_bucket_is_a_specific_error(s3_bucket):
    """A save to (or gc of) a bucket that does not exist is ``io.read`` naming the URL and saying the bucket is
    missing, never the driver's raw ValueError; a load finds no checkpoint there."""
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run/ckpt"
    got = _errors_of(url)
    for what in ("save", "gc"):
        err = got[what]
        assert isinstance(err, xckpt.XckptError) and err.code == "io.read", (what, repr(err))
        assert "the bucket does not exist" in err.message and err.file is not None and err.file.startswith(url)
    assert isinstance(got["load"], xckpt.XckptError) and got["load"].code == "manifest.missing"


def test_unreachable_store_fails_fast_with_a_specific_error(s3_bucket, monkeypatch):
    """An endpoint nobody listens on: every call fails within its ``AWS_MAX_ATTEMPTS`` with ``io.read`` (a
    finding, for validate) naming the object it asked for, and saying the store cannot be reached."""
    from spawn import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    url = f"s3://ckpts/run-{uuid.uuid4().hex[:6]}/ckpt"
    started = time.monotonic()
    got = _errors_of(url)
    assert time.monotonic() - started < 60
    for what in ("save", "load", "gc"):
        err = got[what]
        assert isinstance(err, xckpt.XckptError) and err.code == "io.read", (what, repr(err))
        assert "cannot be reached" in err.message and err.file is not None and err.file.startswith(url)
    finding = got["validate"]
    assert isinstance(finding, dict) and finding["code"] == "io.read" and finding["file"].startswith(url)


@pytest.mark.parametrize("url", ["s3://", "s3:///ckpt"])
def test_s3_url_without_a_bucket_is_refused(tmp_path, monkeypatch, url):
    """``s3://`` names no bucket: refused (``unsupported``), and never taken for the local directory ``s3:``."""
    monkeypatch.chdir(tmp_path)
    for fn in (lambda: xckpt.save({"w": np.ones(2)}, url), lambda: xckpt.load(url)):
        with pytest.raises(xckpt.XckptError) as info:
            fn()
        assert info.value.code == "unsupported" and "names no bucket" in info.value.message
    assert os.listdir(tmp_path) == []


def test_many_small_leaves_on_s3_load_exactly_and_each_defect_names_its_leaf(s3_bucket):
    """Small objects and ``zarr.json`` files are fetched from an object store many at once (Store.prefetch): a
    load of 300 small leaves is exact, and a missing, corrupt, oversized or truncated one, or a missing
    ``zarr.json``, is still its own specific error naming the leaf and the object, as read one by one."""
    url = f"s3://ckpts/run-{uuid.uuid4().hex[:6]}/many"
    rng = np.random.default_rng(3)
    tree = {f"v{i}": rng.standard_normal(64 + i).astype(np.float32) for i in range(300)}
    tree["w"] = rng.standard_normal((256, 128)).astype(np.float32)  # one object above the small size
    xckpt.save(tree, url)
    out = xckpt.load(url)
    for k, v in tree.items():
        np.testing.assert_array_equal(out[k], v, err_msg=k)
    prefix = url[len("s3://ckpts/"):]

    def body(key: str) -> bytes:
        return s3_bucket.get_object(Bucket="ckpts", Key=f"{prefix}/{key}")["Body"].read()

    def put(key: str, data: bytes | None) -> None:
        if data is None:
            s3_bucket.delete_object(Bucket="ckpts", Key=f"{prefix}/{key}")
        else:
            s3_bucket.put_object(Bucket="ckpts", Key=f"{prefix}/{key}", Body=data)

    def refused(key: str, data: bytes | None, code: str, leaf: str) -> None:
        old = body(key)
        put(key, data)
        try:
            with pytest.raises(xckpt.XckptError) as info:
                xckpt.load(url)
            assert (info.value.code, info.value.leaf) == (code, leaf), str(info.value)
            assert info.value.file == f"{url}/{key}", str(info.value)
        finally:
            put(key, old)

    flipped = bytearray(body("v120/c/0"))
    flipped[3] ^= 0xFF
    refused("v120/c/0", bytes(flipped), "chunk.crc32c", "v120")
    refused("v7/c/0", None, "chunk.missing", "v7")
    refused("v250/c/0", body("v250/c/0")[:20], "chunk.truncated", "v250")  # shorter than its index
    refused("v33/c/0", bytes(70_000) + body("v33/c/0"), "chunk.crc32c", "v33")  # too large to fetch whole
    refused("v299/zarr.json", None, "array.metadata_missing", "v299")
    out = xckpt.load(url)  # every object put back: exact again
    for k, v in tree.items():
        np.testing.assert_array_equal(out[k], v, err_msg=k)
