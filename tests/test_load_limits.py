"""What a load may allocate: no more than the process is allowed (its address-space limit, not only the
machine's memory), and never what a hostile header declares. Found by tests/test_fuzz.py once its base
vectors changed (a MemoryError escaped instead of a specific error)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zstandard

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


def test_a_manifest_declaring_millions_of_tiny_inner_chunks_fails_on_its_first_missing_object(tmp_path) -> None:
    """A leaf of 2**24 int16 in 16 objects of 2**19 inner chunks of 2 elements each, whose objects are not there:
    the load refuses it (``chunk.missing``) once it opens the first object. Before, every inner chunk's part was
    planned first: 8 million of them, about 2.5 GB of Python objects, which a process held to 1.5 GiB of address
    space more than it started with could not make (a MemoryError)."""
    import json

    import xckpt

    path = tmp_path / "ckpt"
    xckpt.save({"x": np.zeros(4, np.int16)}, path)
    m = json.loads((path / "xckpt.json").read_text())
    m["leaves"][0].update(shape=[2**24], chunk_shape=[2**20], inner_chunk_shape=[2],
                          sharding={"shard_shape": [2**20], "num_shards": 16})
    (path / "xckpt.json").write_text(json.dumps(m))
    z = json.loads((path / "x" / "zarr.json").read_text())
    z["shape"] = [2**24]
    z["chunk_grid"]["configuration"]["chunk_shape"] = [2**20]
    z["codecs"][0]["configuration"]["chunk_shape"] = [2]
    (path / "x" / "zarr.json").write_text(json.dumps(z))
    for obj in (path / "x" / "c").iterdir():
        obj.unlink()
    script = textwrap.dedent(f"""
        import resource, sys
        import numpy as np
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
    code, leaf, file = out.stdout.split()
    assert (code, leaf) == ("chunk.missing", "x") and file.startswith(str(path / "x" / "c")), out.stdout
