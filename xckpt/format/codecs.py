"""The one compressor the format allows inside an inner chunk: zstd (Zarr v3's ``zstd`` codec)."""

from __future__ import annotations

from typing import Any

from xckpt.errors import DataError, ResourceError

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
    data = bytes(data)
    try:
        declared = z.frame_content_size(data)  # the decoder allocates what the header declares: check it first
        if declared not in (-1, expected):
            raise DataError(f"zstd frame declares {declared} bytes, expected {expected}", code="chunk.codec")
        out = z.ZstdDecompressor().decompress(data, max_output_size=expected)
    except z.ZstdError as exc:
        raise DataError(f"zstd frame cannot be decoded: {exc}", code="chunk.codec") from None
    if len(out) != expected:
        raise DataError(f"zstd frame holds {len(out)} bytes, expected {expected}", code="chunk.codec")
    return out


def zstd_stream_decompress(data: Any, limit: int) -> bytes:
    """The bytes of a zstd stream (one frame or several, with or without their content size, as a streaming
    compressor writes them), refused once they pass ``limit`` bytes (``resource.too_large``: a few compressed
    bytes can stand for any number), and when corrupt or cut short (``chunk.codec``).

    A first pass counts the bytes in bounded reads, keeping none; only then are the frames decoded."""
    import io

    z = _zstd()
    data = bytes(data)
    total = 0
    try:
        with z.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as r:
            while True:
                part = r.read(min(1 << 24, limit + 1 - total))
                if not part:
                    break
                total += len(part)
                if total > limit:
                    raise ResourceError(f"a zstd stream expands past {limit} bytes")
        out = bytearray()
        rest = data
        while rest:  # frame by frame: each must end where the stream says (a stream cut short does not)
            frame = z.ZstdDecompressor().decompressobj()
            out += frame.decompress(rest)
            if not frame.eof:
                raise DataError("zstd stream is cut short", code="chunk.codec")
            rest = frame.unused_data
    except z.ZstdError as exc:
        raise DataError(f"zstd stream cannot be decoded: {exc}", code="chunk.codec") from None
    return bytes(out)
