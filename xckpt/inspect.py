"""``xckpt inspect``: what a checkpoint holds, leaf by leaf."""

from __future__ import annotations

from typing import Any

from xckpt.format.manifest import ArrayEntry
from xckpt.sources.detect import open_checkpoint
from xckpt.format.tree import key_str


def inspect(path: Any) -> dict[str, Any]:
    """A JSON-able summary: producer, every leaf (shape, dtype, bytes, saved sharding), totals."""
    ckpt = open_checkpoint(path)
    m = ckpt.manifest
    leaves = []
    total = 0
    for e in m.leaves:
        if isinstance(e, ArrayEntry):
            total += e.nbytes
            leaves.append({"key": key_str(e.key), "kind": "array", "shape": list(e.shape), "dtype": e.dtype,
                           "bytes": e.nbytes, "chunk_shape": list(e.chunk_shape), "sharding": e.sharding})
        else:
            leaves.append({"key": key_str(e.key), "kind": "value", "type": e.type})
    return {"path": str(ckpt.loc), "format": ckpt.format, "version": m.version if ckpt.format == "xckpt" else None, "producer": m.producer,
            "leaves": leaves, "arrays": sum(1 for e in m.leaves if isinstance(e, ArrayEntry)),
            "values": sum(1 for e in m.leaves if not isinstance(e, ArrayEntry)), "total_bytes": total}
