"""The one compressor the format allows inside an inner chunk: zstd (Zarr v3's ``zstd`` codec)."""

from __future__ import annotations

from typing import Any

from xckpt.errors import DataError

#: zstd level xckpt writes (the ``level`` of the codec's configuration in ``zarr.json``).
ZSTD_LEVEL = 3


def _zstd() -> Any:
    import zstandard
    return zstandard


def zstd_compress(data: Any) -> bytes:
    """One zstd frame of ``data`` (a bytes-like object), with its content size in the header."""
    return _zstd().ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def zstd_decompress(data: Any, expected: int) -> bytes:
    """Undo :func:`zstd_compress`; refuses a frame that is corrupt or does not hold ``expected`` bytes."""
    z = _zstd()
    try:
        out = z.ZstdDecompressor().decompress(bytes(data), max_output_size=expected)
    except z.ZstdError as exc:
        raise DataError(f"zstd frame cannot be decoded: {exc}", code="chunk.codec") from None
    if len(out) != expected:
        raise DataError(f"zstd frame holds {len(out)} bytes, expected {expected}", code="chunk.codec")
    return out
