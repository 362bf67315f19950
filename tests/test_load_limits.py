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
