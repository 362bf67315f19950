"""What a load may allocate: no more than the process is allowed (its address-space limit, not only the
machine's memory), and never what a hostile header declares. Found by tests/test_fuzz.py once its base
vectors changed (a MemoryError escaped instead of a specific error)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from xckpt.errors import DataError
from xckpt.format.codecs import zstd_compress, zstd_decompress


def _lying_frame(payload: bytes, declared: int) -> bytes:
    """A zstd frame of ``payload`` whose header declares ``declared`` bytes of content (8-byte field)."""
    plain = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(payload)
    fhd = plain[4]
    assert fhd >> 6 == 0 and not fhd & 0x20 and not fhd & 0x03, "unexpected zstd frame header"
    return plain[:4] + bytes([fhd | 0xC0]) + plain[5:6] + declared.to_bytes(8, "little") + plain[6:]


def test_a_zstd_header_declaring_a_terabyte_is_refused_before_any_allocation() -> None:
    with pytest.raises(DataError) as info:
        zstd_decompress(_lying_frame(b"\1" * 64, 1 << 40), 64)
    assert info.value.code == "chunk.codec" and "declares 1099511627776 bytes, expected 64" in info.value.message
    with pytest.raises(DataError) as info:
        zstd_decompress(_lying_frame(b"\1" * 64, 63), 64)
    assert info.value.code == "chunk.codec"
    data = np.arange(16, dtype=np.float32).tobytes()
    assert zstd_decompress(zstd_compress(data), len(data)) == data
    assert zstd_decompress(zstandard.ZstdCompressor(write_content_size=False).compress(data), len(data)) == data
    with pytest.raises(DataError) as info:  # no declared size, more bytes than expected
        zstd_decompress(zstandard.ZstdCompressor(write_content_size=False).compress(data), len(data) - 4)
    assert info.value.code == "chunk.codec"


def test_a_process_held_to_less_memory_loads_within_that_limit() -> None:
    """Under ``RLIMIT_AS`` the load's memory limit is the address-space limit (before: the machine's memory, so a
    leaf declaring more than the process may map raised a bare MemoryError), and an allocation the system
    refuses anyway is ``resource.too_large``."""
    script = textwrap.dedent("""
        import resource, numpy as np
        from xckpt.engine.read import empty, memory_limit
        from xckpt.errors import ResourceError
        before = memory_limit()
        limit = 3 << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        assert memory_limit() == min(before, limit), (memory_limit(), before, limit)
        try:
            empty((1 << 32,), np.dtype(np.float32))
        except ResourceError as exc:
            assert exc.code == "resource.too_large" and "17179869184 bytes" in exc.message, exc
        else:
            raise AssertionError("16 GiB allocated under a 3 GiB address-space limit")
        a = empty((1024,), np.dtype(np.float64))
        assert a.shape == (1024,) and a.ctypes.data % 64 == 0
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _declaring(path: Path, dtype: type, shape: int, chunk: int, inner: int) -> Path:
    """A checkpoint of one 1-d leaf ``x`` whose manifest and zarr.json agree on the declared ``shape``, ``chunk``
    and ``inner`` chunk (its one small object, written for 4 elements, left as it is)."""
    import xckpt

    xckpt.save({"x": np.zeros(4, dtype)}, path)
    m = json.loads((path / "xckpt.json").read_text())
    m["leaves"][0].update(shape=[shape], chunk_shape=[chunk], inner_chunk_shape=[inner],
                          sharding={"shard_shape": [chunk], "num_shards": shape // chunk})
    (path / "xckpt.json").write_text(json.dumps(m))
    z = json.loads((path / "x" / "zarr.json").read_text())
    z["shape"] = [shape]
    z["chunk_grid"]["configuration"]["chunk_shape"] = [chunk]
    z["codecs"][0]["configuration"]["chunk_shape"] = [inner]
    (path / "x" / "zarr.json").write_text(json.dumps(z))
    return path


def _load_held(path: Path) -> list[str]:
    """Load ``path`` in a process held to 1.5 GiB of address space more than it maps before; the code, leaf and
    file of the XckptError it raises."""
    script = textwrap.dedent(f"""
        import resource
        import xckpt
        from xckpt.errors import XckptError
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (3 << 29), resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:
            xckpt.load({str(path)!r})
        except XckptError as exc:
            print(exc.code, exc.leaf, exc.file)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_a_manifest_declaring_millions_of_tiny_inner_chunks_fails_on_its_first_missing_object(tmp_path: Path) -> None:
    """A leaf of 2**24 int16 in 16 objects of 2**19 inner chunks of 2 elements each, whose objects are not there:
    the load refuses it (``chunk.missing``) once it opens the first object. Before, every inner chunk's part was
    planned first: 8 million of them, about 2.5 GB of Python objects, which a process held to 1.5 GiB of address
    space more than it started with could not make (a MemoryError)."""
    path = _declaring(tmp_path / "ckpt", np.int16, 2**24, 2**20, 2)
    for obj in (path / "x" / "c").iterdir():
        obj.unlink()
    code, leaf, file = _load_held(path)
    assert (code, leaf) == ("chunk.missing", "x") and file.startswith(str(path / "x" / "c")), (code, leaf, file)


def test_a_manifest_declaring_millions_of_one_byte_objects_is_refused_before_planning(tmp_path: Path) -> None:
    """A leaf of 2**22 uint8 in 2**22 one-element chunk objects (4 MiB of data, no writer makes such a grid): the
    read would plan 4 million objects (about 2 GB before the first is opened); it is ``resource.too_large``
    naming the leaf's zarr.json, before any is planned, under an address-space limit that planning them would
    pass (before: a MemoryError)."""
    path = _declaring(tmp_path / "ckpt", np.uint8, 2**22, 1, 1)
    assert _load_held(path) == ["resource.too_large", "x", str(path / "x" / "zarr.json")]


def test_a_read_of_many_small_leaves_is_not_refused(tmp_path: Path) -> None:
    """The bound counts objects against bytes with a million to spare: 3,000 leaves of 4 bytes load."""
    import xckpt

    tree = {f"v{i}": np.full(1, i, np.int32) for i in range(3000)}
    xckpt.save(tree, tmp_path / "c")
    got = xckpt.load(tmp_path / "c")
    assert all(np.array_equal(got[k], v) for k, v in tree.items())


def test_a_failed_read_of_many_objects_stops_after_its_window(tmp_path: Path, monkeypatch) -> None:
    """A leaf declaring 4,096 objects of 64 KiB, none of them readable (the one object there was written for 4
    elements): the load fails on the first (naming it), having tried at most the objects in flight at once
    (one per I/O thread, :class:`xckpt.engine.threads.Pump`), not all 4,096 (before: every object was
    submitted, then tried, before the error was raised; a fuzzed manifest of 262,144 such objects took longer
    than the fuzzer's 10 s)."""
    import xckpt
    from xckpt.engine import read, threads

    path = _declaring(tmp_path / "ckpt", np.uint8, 2**28, 2**16, 2**16)
    tried: list[str] = []
    real = read._read_object

    def counting(store, obj, *args, **kwargs):  # noqa: ANN001, ANN202 - the engine's own signature
        tried.append(obj.name)
        return real(store, obj, *args, **kwargs)

    monkeypatch.setattr(read, "_read_object", counting)
    with pytest.raises(xckpt.XckptError) as err:
        xckpt.load(path)
    assert err.value.code in ("chunk.missing", "chunk.truncated") and err.value.leaf == "x", err.value
    assert 1 <= len(tried) <= threads.io_threads() + 1, len(tried)


def test_a_read_plans_its_objects_as_it_reads_them(tmp_path: Path, monkeypatch) -> None:
    """A leaf of 2**20 float64 in 2**20 one-element objects (within the object bound for its 8 MiB), none of
    them readable: the load fails on the first, having planned no more objects than one window of small ones
    (:data:`xckpt.engine.read.PREFETCH_WINDOW`). Found by a wider fuzz sweep: every object was planned before
    the first was opened, 16 s for this leaf, past the fuzzer's 10 s."""
    import xckpt
    from xckpt.engine import read

    path = _declaring(tmp_path / "ckpt", np.float64, 2**20, 1, 1)
    planned: list[str] = []
    real = read._Object

    def counting(name, *args, **kwargs):  # noqa: ANN001, ANN202 - the engine's own signature
        planned.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(read, "_Object", counting)
    with pytest.raises(xckpt.XckptError) as err:
        xckpt.load(path)
    # its first object, written for 4 elements, has the wrong inner chunk size; the next are missing
    assert err.value.code in ("chunk.size", "chunk.missing") and err.value.leaf == "x", err.value
    assert err.value.file == str(path / "x" / "c" / "0"), err.value.file
    assert 1 <= len(planned) <= read.PREFETCH_WINDOW, len(planned)


def test_requests_for_the_same_array_each_get_their_part(tmp_path: Path) -> None:
    """Several requests of one stored array in one read each get theirs, the whole of a one-object leaf twice
    included (before, the second such request replaced the first, whose output stayed as it was), and parts
    of a many-object array that overlap (each object opened once for all)."""
    import xckpt
    from xckpt.engine.read import ReadRequest
    from xckpt.format.regions import Region
    from xckpt.sources.detect import open_checkpoint

    big = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    xckpt.save({"v": np.arange(5, dtype=np.float32), "m": big}, tmp_path / "c", inner_chunk_bytes=1024)
    ckpt = open_checkpoint(tmp_path / "c")
    try:
        v, m = (next(e for e in ckpt.manifest.leaves if e.key == (k,)) for k in ("v", "m"))
        assert len(m.arrays()[0].chunk_shape) == 2
        outs = [np.full(5, -1, np.float32), np.full(5, -1, np.float32)]
        regions = [Region((0, 0), (64, 48)), Region((10, 5), (30, 20)), Region((20, 0), (44, 48))]
        parts = [np.full(r.sizes, -1, np.float32) for r in regions]
        ckpt.read([ReadRequest(v, Region.full((5,)), outs[0]), ReadRequest(m, regions[0], parts[0]),
                   ReadRequest(v, Region.full((5,)), outs[1]), ReadRequest(m, regions[1], parts[1]),
                   ReadRequest(m, regions[2], parts[2])])
    finally:
        ckpt.close()
    for out in outs:
        np.testing.assert_array_equal(out, np.arange(5, dtype=np.float32))
    for r, part in zip(regions, parts):
        np.testing.assert_array_equal(part, big[r.slices()])


def test_validating_a_grid_of_millions_of_chunks_walks_only_what_is_stored(tmp_path: Path) -> None:
    """A leaf declaring 2**24 one-byte chunk objects (the most a leaf may), one of them stored: the validator
    reports the first 16 missing chunks and counts the rest exactly, walking the grid only as far as those (before:
    all 16 million chunk names were built and looked up)."""
    import xckpt
    from xckpt.validate import MAX_MISSING_LISTED

    path = _declaring(tmp_path / "ckpt", np.uint8, 2**24, 1, 1)
    findings = xckpt.validate(path).findings
    missing = [f for f in findings if f.code == "chunk.missing"]
    assert [f.file for f in missing[:MAX_MISSING_LISTED]] == [str(path / "x" / "c" / str(i))
                                                             for i in range(1, MAX_MISSING_LISTED + 1)]
    assert len(missing) == MAX_MISSING_LISTED + 1
    assert missing[-1].message == f"{2**24 - 1 - MAX_MISSING_LISTED} more chunks of this array are missing"


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 60), st.integers(1, 4), st.sets(st.integers(0, 59), max_size=3), st.booleans())
def test_a_pump_runs_each_item_once_and_raises_the_earliest_error(n: int, workers: int, failing: set[int],
                                                                  plan_fails: bool) -> None:
    """The I/O threads' pump (one loop per worker, each taking the next item as it finishes one): without an
    error, every item runs exactly once and the results add up; with errors (an item's, or the planning
    generator's own), the one raised is that of the earliest item taken among those that failed, and no item
    past a failing planning step is taken."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from xckpt.engine import threads

    ran: list[int] = []
    lock = threading.Lock()
    stop = n // 2 if plan_fails and n else None

    def items():
        for i in range(n):
            if i == stop:
                raise RuntimeError(f"plan {i}")
            yield i

    def fn(i: int) -> int:
        with lock:
            ran.append(i)
        if i in failing:
            raise ValueError(f"item {i}")
        return i + 1

    with ThreadPoolExecutor(4) as ex:
        pump = threads.Pump(ex, fn, items(), workers)
        errors = sorted(i for i in failing if i < n)
        if not errors and stop is None:
            assert pump.finish() == sum(i + 1 for i in range(n))
            assert sorted(ran) == list(range(n))
            return
        with pytest.raises((ValueError, RuntimeError)) as info:
            pump.finish()
    assert len(ran) == len(set(ran))  # none twice
    first_bad = min([i for i in errors if i in ran] + ([stop] if stop is not None else []))
    want = f"plan {first_bad}" if first_bad == stop else f"item {first_bad}"
    assert str(info.value) == want
    assert stop is None or max(ran, default=-1) < stop


def test_a_checking_pass_keeps_only_small_arrays_objects(tmp_path: Path) -> None:
    """The objects a checking pass keeps for the filling pass are small arrays' (counted against the bound
    before the pass), never a large array's object that compressed small; the read that follows fills
    every output from them and from the store, element by element."""
    import xckpt
    from xckpt.engine.read import ReadRequest, SMALL_OBJECT, placeholder
    from xckpt.format import dtypes
    from xckpt.format.manifest import ArrayEntry
    from xckpt.format.regions import Region
    from xckpt.sources.detect import open_checkpoint

    rng = np.random.default_rng(1)
    tree = {"zeros": np.zeros((512, 512), np.float32), **{f"v{i}": rng.random(64, dtype=np.float32) for i in range(5)}}
    xckpt.save(tree, str(tmp_path / "c"), compression="zstd")
    ckpt = open_checkpoint(tmp_path / "c")
    try:
        entries = {e.key[-1]: e for e in ckpt.manifest.leaves if isinstance(e, ArrayEntry)}
        (zeros,) = entries["zeros"].arrays()
        assert (tmp_path / "c" / zeros.path / "c" / "0" / "0").stat().st_size < SMALL_OBJECT  # compressed small
        ckpt.check([ReadRequest(e, Region.full(e.shape),
                                placeholder(e.shape, dtypes.numpy_dtype(e.storage_dtype))) for e in entries.values()])
        assert sorted(ckpt._memo.kept) == sorted(f"{a.path}/c/0" for k, e in entries.items() if k != "zeros"
                                                 for a in e.arrays())
        outs = {k: np.full(e.shape, np.nan, np.float32) for k, e in entries.items()}
        ckpt.read([ReadRequest(e, Region.full(e.shape), outs[k]) for k, e in entries.items()])
    finally:
        ckpt.close()
    for k, want in tree.items():
        np.testing.assert_array_equal(outs[k], want)
