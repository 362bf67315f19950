"""The files that let plain Orbax restore an xckpt checkpoint without conversion.

Orbax sees every array leaf (except the float8 family, stored as raw bytes, and so
left out rather than misread) as an ``np.ndarray`` leaf: restored with no target it
gives numpy, restored with a target of sharded ``jax.ShapeDtypeStruct`` it gives
``jax.Array`` on that sharding. Numeric scalar values are mirrored as 0-d arrays,
strings go to ``_strings.json``, None and empty containers are recorded as Orbax
records them. ``bytes`` and ``complex`` values have no Orbax form and are left out.

Orbax v1 (``ocp.v1.load``) sees the checkpoint as a v0 PyTree checkpoint (``_CHECKPOINT_METADATA``
whose ``item_handlers`` is one handler, ``_METADATA`` at the top; no ``orbax.checkpoint`` marker,
which would make it look for a ``state/`` subdirectory instead). Before loading, it looks for
TensorStore data: a top-level ``manifest.ocdbt``, or a top-level directory holding a ``.zarray``
file (zarr v2; xckpt's zarr v3 arrays do not count), and logs that the checkpoint may be
malformed when there is none. :data:`MARKER` is that ``.zarray``: the metadata of an empty zarr
v2 array, in a hidden directory that no leaf's storage name can take (storage names never start
with ``.``).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable

import numpy as np

from xckpt.format import dtypes, names as naming, zarr
from xckpt.format.manifest import ArrayEntry, Entry, Manifest, ValueEntry
from xckpt.format.tree import Key, iter_nodes

#: ``key_type`` of an Orbax key: a sequence index, a dict key.
KEY_SEQUENCE, KEY_DICT = 1, 2
HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
_SCALAR_DTYPES = {"bool": "bool", "int": "int64", "float": "float64"}
#: The directory of :data:`MARKER` (a top-level name of every checkpoint, see the module documentation).
MARKER_DIR = naming.ORBAX_MARKER_DIR
#: What Orbax v1 looks for before it loads: a top-level directory holding a zarr v2 ``.zarray``.
MARKER = naming.ORBAX_MARKER
#: :data:`MARKER`'s bytes: a valid zarr v2 array of shape [0] (no chunk), which nothing ever reads.
MARKER_ZARRAY = json.dumps({"zarr_format": 2, "shape": [0], "chunks": [1], "dtype": "|u1", "compressor": None,
                            "fill_value": 0, "order": "C", "filters": None, "dimension_separator": "."},
                           separators=(",", ":")).encode()


def _tree_key(key: Key) -> str:
    return str(tuple(str(k) for k in key))


def _key_metadata(kinds: dict[Key, str], key: Key) -> list[dict[str, Any]]:
    out = []
    for depth, part in enumerate(key):
        parent = kinds.get(key[:depth], "dict")
        out.append({"key": str(part), "key_type": KEY_SEQUENCE if parent in ("list", "tuple") else KEY_DICT})
    return out


def _record(kinds: dict[Key, str], key: Key, value_type: str, skip: bool = False, **extra: Any) -> tuple[str, Any]:
    meta = {"value_type": value_type, "skip_deserialize": skip}
    meta.update(extra)
    return _tree_key(key), {"key_metadata": _key_metadata(kinds, key), "value_metadata": meta}


def metadata_json(m: Manifest, string_keys: Iterable[Key] = ()) -> bytes:
    """Orbax's ``_METADATA`` for a manifest whose string values are at ``string_keys``.

    Leaves Orbax cannot read as one array (raw float8 bytes, segmented leaves) are left out. It
    depends on the tree, the array leaves' dtypes and chunk shapes, and the kinds of the value
    leaves (:func:`values_signature`), not on the values.
    """
    kinds = {k: n["kind"] for k, n in iter_nodes(m.tree)}
    tree: dict[str, Any] = {}
    for e in m.leaves:
        if isinstance(e, ArrayEntry):
            if not dtypes.is_raw(e.dtype) and e.segments is None:
                k, v = _record(kinds, e.key, "np.ndarray", write_shape=list(e.chunk_shape))
                tree[k] = v
        elif e.orbax_path:
            k, v = _record(kinds, e.key, "scalar")
            tree[k] = v
        elif e.type == "none":
            k, v = _record(kinds, e.key, "None", True)
            tree[k] = v
    for key, node in iter_nodes(m.tree):
        if node["kind"] in ("dict", "namedtuple", "list", "tuple") and not node["items"] and key:
            k, v = _record(kinds, key, "Dict" if node["kind"] in ("dict", "namedtuple") else "List", True)
            tree[k] = v
    for key in string_keys:
        k, v = _record(kinds, key, "string")
        tree[k] = v
    return json.dumps({"tree_metadata": tree, "use_zarr3": True, "use_ocdbt": False,
                       "store_array_data_equal_to_fill_value": True, "custom_metadata": None},
                      separators=(",", ":")).encode()


def values_signature(m: Manifest) -> tuple[tuple[str, bool], ...]:
    """What ``_METADATA`` takes from a manifest's value leaves: each one's type and whether it is mirrored.
    Two saves of one plan with the same signature have the same ``_METADATA``."""
    return tuple((e.type, e.orbax_path is not None) for e in m.leaves if isinstance(e, ValueEntry))


def files(metadata: bytes, string_values: dict[Key, str]) -> dict[str, bytes]:
    """Every Orbax file of a checkpoint whose ``_METADATA`` is ``metadata`` (:func:`metadata_json`) and whose
    string values are ``string_values``: ``_METADATA``, ``_CHECKPOINT_METADATA``, :data:`MARKER`, and
    ``_strings.json`` when there are strings."""
    now = time.time_ns()
    out = {
        naming.ORBAX_METADATA: metadata,
        naming.ORBAX_CHECKPOINT_METADATA: json.dumps({
            "item_handlers": HANDLER, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}).encode(),
        MARKER: MARKER_ZARRAY,
    }
    if string_values:
        out["_strings.json"] = json.dumps(strings_object(string_values)).encode()
    return out


def strings_object(string_values: dict[Key, str]) -> dict[str, Any]:
    """What ``_strings.json`` holds: each string at the JSON pointer of its storage name, where Orbax
    looks it up (a name that nests in directories, ``run/name``, nests in objects: ``{"run": {"name": ...}}``)."""
    strings: dict[str, Any] = {}
    for key, text in string_values.items():
        *outer, last = ".".join(str(p) for p in key).split("/")
        node = strings
        for part in outer:  # storage names never nest in one another (names.check_unique)
            node = node.setdefault(part, {})
        node[last] = text
    return strings


def in_strings(e: Entry) -> bool:
    """Whether a value leaf is one of the strings Orbax restores from ``_strings.json``: a str whose key holds
    no ``~`` (Orbax looks a string up by a JSON pointer made of its key, unescaped: a ``~`` in it fails the
    whole restore)."""
    return isinstance(e, ValueEntry) and e.type == "str" and not any("~" in str(k) for k in e.key)


def mirrors(value: Any) -> bool:
    """Whether a value leaf gets a 0-d mirror array that Orbax restores as a scalar."""
    if isinstance(value, bool) or isinstance(value, float):
        return True
    return isinstance(value, int) and -(2**63) <= value < 2**63


def scalar_array(value: Any) -> tuple[dict[str, Any], np.ndarray]:
    """The ``zarr.json`` and data of the 0-d array that mirrors a numeric value leaf for Orbax."""
    storage_dtype = _SCALAR_DTYPES[type(value).__name__]
    return zarr.zarr_metadata([], storage_dtype, [], []), np.asarray(value, dtype=storage_dtype)
