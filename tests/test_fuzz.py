"""Fuzz: a reader that trusts nothing. Seeded mutations of the conformance vectors must make
``xckpt.load`` and ``xckpt.inspect`` succeed or raise an :class:`~xckpt.errors.XckptError` with a
code, and make ``xckpt.validate(deep=True)`` return a report (never raise: the root is readable);
no case may hang or allocate more than 1 GiB, save the arrays a load returns: a manifest and its
``zarr.json`` that agree on a large shape declare that much data, so the load allocates it, and
memory the system refuses for it is ``resource.too_large`` naming the leaf (:func:`_declared`).

Design
------
* Base checkpoints: copies of every ``spec/conformance/valid/*/checkpoint``, read at run time. Files
  are found by walking: the manifest ``xckpt.json``, ``values.msgpack``, every ``zarr.json`` and,
  under each array's directory, its chunk objects ``c`` / ``c/...`` (the number of inner chunks of
  an object comes from its ``zarr.json``).
* :data:`CASES` cases per target, case ``n`` built by ``random.Random(SEED + n)`` alone (its seed):

  - ``manifest``: JSON mutations (any value anywhere replaced by another type, a float for an int,
    ``2**70``, negatives, ``"\\ud800"``, 5000-digit numbers, NaN, deep nesting, empty containers,
    null; members deleted, duplicated (duplicate JSON keys too), added, swapped), byte flips,
    truncations and insertions, and "consistent" mutations that change an array leaf's shape,
    chunking, dtype or compression in the manifest *and* its ``zarr.json`` together, so the checks
    behind the metadata comparison (sizes, allocation, iteration over chunks) are reached;
  - ``zarr``: the same JSON and byte mutations of one ``zarr.json``;
  - ``shard``: the index at the end of a chunk object (``16 * n + 4`` bytes): offsets and sizes out
    of range, overlapping, huge, ``2**64 - 1``, swapped or duplicated entries, the object truncated
    or grown, inner chunks replaced by payloads of the wrong size or by corrupt or lying zstd frames;
    the index's crc32c (and an inner chunk's) is recomputed in most cases, so the structural checks
    run, not only the checksum;
  - ``values``: ``values.msgpack`` mutated as a msgpack tree (type changes, bad or unknown extension
    types, malformed payloads, non-int keys, deep nesting, length headers claiming gigabytes) or as
    bytes, with the manifest's ``values`` size and crc32c recomputed in most cases so decoding runs;
  - ``orbax``: the JSON and byte mutations of ``_METADATA``, ``_CHECKPOINT_METADATA`` or
    ``_strings.json`` (only ``validate`` reads them: it must report, not raise).

* Every case runs ``xckpt.inspect``, ``xckpt.load`` and ``xckpt.validate(path, deep=True)``. A
  failure is: any other exception escaping (a ``MemoryError`` anywhere in an error's chain
  included), an ``XckptError`` with an empty code, ``validate`` raising, a load refused with a code
  that deep validation reports nothing about (``validate-missed``), a hang, or a crash.
* The cases run in child processes (:data:`WORKERS` in parallel, each restarted after the case a
  crash or hang ended it). A child imports xckpt, numpy and TensorStore, loads and validates every
  base once, then caps its address space (``RLIMIT_AS``) at its size plus :data:`HEADROOM` (1 GiB),
  so any allocation of more than 1 GiB fails as ``MemoryError``. Each case has :data:`CASE_TIMEOUT`
  seconds: SIGALRM raises :class:`Hang` in it (a traceback names where it hung), and
  ``faulthandler.dump_traceback_later(..., exit=True)`` ends a child stuck in C code (the parent
  names the case and restarts the child after it). Each child logs every case as it begins and
  ends, and prints a JSON summary (cases per target, outcomes, failures with seed, file, mutation
  and traceback); the test asserts on them and prints every failing case.

Reproduce a case: ``python tests/test_fuzz.py --repro SEED [--keep DIR]`` (prints the mutation, each
outcome and full tracebacks; ``--keep`` leaves the mutated checkpoint in ``DIR``).

Known failures may be marked in :data:`KNOWN` while their cause is being fixed: a failure that
matches a mark is printed but does not fail the test, one that matches none fails it, and the test
warns about marks that no case matches any more. There are none.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
VALID = REPO / "spec" / "conformance" / "valid"

#: Cases per target (1,000 or more in all).
CASES = {"manifest": 340, "zarr": 250, "shard": 280, "values": 250, "orbax": 80}
#: Case ``n`` is built by ``random.Random(SEED + n)``.
SEED = 1_000_000
#: Seconds one case (inspect, load and deep validate) may take.
CASE_TIMEOUT = 10
#: Bytes a case may allocate beyond what the child holds after its warm-up.
HEADROOM = 1 << 30
#: Child processes run in parallel (the cases are dealt out round-robin).
WORKERS = max(1, min(2, os.cpu_count() or 1))
#: Restarts after crashes or hangs, per worker, before the test gives up on the rest.
MAX_RESTARTS = 8
#: Codes a load may refuse with although the checkpoint conforms (so deep validation may find nothing).
NOT_DEFECTS = frozenset({"resource.too_large"})


@dataclass(frozen=True)
class Known:
    """A known failure, marked until the lead fixes it: the failure's kind must be one of ``kinds``, its
    exception type ``exc`` (or any, when empty), and ``where`` (``file:function``, or ``load:CODE`` for a
    ``validate-missed``) must be one of its innermost xckpt frames."""

    todo: str
    kinds: tuple[str, ...]
    exc: str
    where: str

    def matches(self, failure: dict[str, Any]) -> bool:
        """Whether ``failure`` is this known one."""
        return (failure["kind"] in self.kinds and (not self.exc or failure["exc"] == self.exc)
                and any(self.where == w for w in failure["where"]))


#: Known failures (see the module docstring): none.
KNOWN: list[Known] = []


# -- JSON mutations --------------------------------------------------------------------------------


class _Raw(str):
    """JSON text written as it is (deep nesting, 5000-digit numbers, NaN)."""


class _Pairs(list):
    """A JSON object written member by member: ``[(key, value), ...]``, duplicate keys allowed."""


def _dump(v: Any) -> str:
    """JSON text of a mutated document (``\\ud800`` escapes for lone surrogates)."""
    if isinstance(v, _Raw):
        return str(v)
    if isinstance(v, _Pairs):
        return "{" + ",".join(json.dumps(k) + ":" + _dump(x) for k, x in v) + "}"
    if isinstance(v, dict):
        return "{" + ",".join(json.dumps(k) + ":" + _dump(x) for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_dump(x) for x in v) + "]"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    return json.dumps(v)


def _nest(depth: int, obj: bool) -> _Raw:
    return _Raw('{"a":' * depth + "0" + "}" * depth if obj else "[" * depth + "]" * depth)


_EVIL_JSON: list[Any] = [
    1.0, 0.5, -1.0, -1, 0, 1, 2, 2**31, 2**32, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70,
    -(2**63), -(2**70), _Raw("1" * 5000), _Raw("-" + "9" * 4400), _Raw("1e400"), _Raw("-1e400"), _Raw("NaN"),
    _Raw("Infinity"), _Raw("1E2"), _Raw("-0"), _Raw("0.0"), _Raw("1e-400"),
    "\ud800", "x\udfff", "\udc80/\ud800", "", ".", "..", "/", "/etc/passwd", "../x", "a/../../x", "c/0", "zarr.json",
    "xckpt.json", "values.msgpack", "\x00", "a\\b", "x" * 5000, "1", "0", "int64", "float32", "bfloat16",
    "complex128", "V8", "|O", "<f4", "none", "zstd", "gzip", "blosc", "array", "value", "leaf", "dict", "group",
    "sharding_indexed", "bytes", "crc32c", "big",
    None, True, False, [], {}, [[]], [0], [-1], [1.0], [2**40, 2**40], [2**62], [1] * 65, [2**31] * 3, [0, 0],
    ["\ud800"], [None], {"": None}, {"kind": "leaf", "index": 0}, {"name": "regular"},
    _nest(64, False), _nest(500, False), _nest(900, False), _nest(5000, False),
    _nest(65, True), _nest(900, True), _nest(5000, True),
]


def _json_paths(v: Any, at: tuple = ()) -> list[tuple]:
    """Every node of a document (not inside ``_Raw``/``_Pairs``), as paths of keys and indices."""
    out, stack = [], [(v, at)]
    while stack:
        n, p = stack.pop()
        out.append(p)
        if isinstance(n, _Pairs) or isinstance(n, _Raw):
            continue
        if isinstance(n, dict):
            stack.extend((x, p + (k,)) for k, x in n.items())
        elif isinstance(n, list):
            stack.extend((x, p + (i,)) for i, x in enumerate(n))
    return sorted(out, key=lambda p: [str(x) for x in p])


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _show(path: tuple) -> str:
    return "/" + "/".join(str(p) for p in path)


def _short(v: Any) -> str:
    text = _dump(v) if not isinstance(v, (bytes, bytearray)) else repr(bytes(v))
    return text if len(text) <= 40 else f"{text[:30]}...<{len(text)} chars>"


def _retype(rng: random.Random, v: Any) -> Any:
    """The same value as another JSON type (1 -> 1.0, "x" -> ["x"], [..] -> {..})."""
    if isinstance(v, bool):
        return rng.choice([int(v), str(v).lower(), None])
    if isinstance(v, int):
        return rng.choice([float(v), str(v), [v], True, _Raw(f"{v}.0"), _Raw(f"{v}e0")])
    if isinstance(v, float):
        return rng.choice([int(v) if math.isfinite(v) else 0, str(v), [v]])
    if isinstance(v, str):
        return rng.choice([[v], {v: v}, len(v), v + "\ud800", v.upper(), v + "/", "./" + v, v + "\x00"])
    if isinstance(v, list):
        return rng.choice([{str(i): x for i, x in enumerate(v)}, v[0] if v else None, [v], v[::-1], v + v])
    if isinstance(v, dict):
        return rng.choice([list(v.values()), [[k, x] for k, x in v.items()], [], None])
    return rng.choice([0, "", [], {}])


def _nudge(rng: random.Random, v: int) -> int:
    return rng.choice([v + 1, v - 1, -v, 0, v * 2, v * 1024, v + 2**32, 2**31, 2**63, 2**64 - 1, 2**53 - 1,
                       max(1, v) ** 3])


def mutate_json(rng: random.Random, doc: Any) -> tuple[Any, str]:
    """One structural mutation of a JSON document; returns the new document and what was done."""
    paths = _json_paths(doc)
    path = rng.choice(paths)
    old = _get(doc, path)
    op = rng.choices(["replace", "retype", "nudge", "delete", "duplicate", "add", "swap"],
                     weights=[6, 3, 3, 2, 2, 1, 1])[0]
    if op == "nudge" and not (isinstance(old, int) and not isinstance(old, bool)):
        op = "replace"
    if op in ("delete", "duplicate") and not path:
        op = "replace"
    if op == "add" and (not isinstance(old, (dict, list)) or isinstance(old, _Pairs)) \
            or op == "swap" and not (isinstance(old, list) and len(old) > 1):  # a _Pairs holds (key, value) pairs only
        op = "replace"
    parent = _get(doc, path[:-1]) if path else None
    key = path[-1] if path else None

    def put(new: Any) -> None:
        nonlocal doc
        if not path:
            doc = new
        else:
            parent[key] = new

    if op == "replace":
        new = rng.choice(_EVIL_JSON)
        put(copy.deepcopy(new))
        return doc, f"{_show(path)} := {_short(new)}"
    if op == "retype":
        new = _retype(rng, old)
        put(new)
        return doc, f"{_show(path)} := {_short(new)} (was {_short(old)})"
    if op == "nudge":
        new = _nudge(rng, old)
        put(new)
        return doc, f"{_show(path)} := {new} (was {old})"
    if op == "delete":
        del parent[key]
        return doc, f"delete {_show(path)}"
    if op == "duplicate":
        if isinstance(parent, list):
            parent.insert(key, copy.deepcopy(old))
            return doc, f"duplicate {_show(path)}"
        twin = copy.deepcopy(old) if rng.random() < 0.5 else rng.choice(_EVIL_JSON)
        pairs = _Pairs()
        for k, x in parent.items():
            pairs.append((k, x))
            if k == key:
                pairs.append((k, twin))
        if len(path) == 1:
            doc = pairs
        else:
            _get(doc, path[:-2])[path[-2]] = pairs
        return doc, f"duplicate key {_show(path)} (second value {_short(twin)})"
    if op == "add":
        new = rng.choice(_EVIL_JSON)
        if isinstance(old, dict):
            name = rng.choice(["x_fuzz", "", "\ud800", "zarr_format", "storage_transformers", "kind", "version"])
            old[name] = copy.deepcopy(new)
            return doc, f"add member {name!r} := {_short(new)} to {_show(path)}"
        old.insert(rng.randrange(len(old) + 1), copy.deepcopy(new))
        return doc, f"insert {_short(new)} into {_show(path)}"
    i, j = rng.sample(range(len(old)), 2)
    old[i], old[j] = old[j], old[i]
    return doc, f"swap {_show(path)}[{i}] and [{j}]"


def mutate_bytes(rng: random.Random, data: bytes, kind: str) -> tuple[bytes, str]:
    """One byte-level mutation; ``kind`` ("json", "msgpack", "binary") adds its own tricks."""
    ops = ["flip", "truncate", "cut", "insert", "repeat", "empty"]
    if kind == "json":
        ops += ["digits", "digits", "bom", "nul", "badutf8", "utf16", "surrogate"]
    if kind == "msgpack":
        ops += ["header", "header", "header"]
    op = rng.choice(ops)
    n = len(data)
    if op == "flip" and n:
        out = bytearray(data)
        spots = sorted(rng.randrange(n) for _ in range(rng.randint(1, 4)))
        for p in spots:
            out[p] ^= rng.randint(1, 255)
        return bytes(out), f"flip bytes at {spots}"
    if op == "truncate" and n:
        p = rng.randrange(n)
        return data[:p], f"truncate to {p} of {n} bytes"
    if op == "cut" and n:
        a = rng.randrange(n)
        b = min(n, a + rng.randint(1, 64))
        return data[:a] + data[b:], f"cut bytes [{a}, {b})"
    if op == "insert":
        p = rng.randrange(n + 1)
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        return data[:p] + junk + data[p:], f"insert {junk!r} at {p}"
    if op == "repeat" and n:
        a = rng.randrange(n)
        b = min(n, a + rng.randint(1, 256))
        return data[:b] + data[a:b] + data[b:], f"repeat bytes [{a}, {b})"
    if op == "digits":
        spots = [i for i in range(n) if data[i:i + 1].isdigit() and (i == 0 or not data[i - 1:i].isdigit())]
        if spots:
            p = rng.choice(spots)
            e = p
            while e < n and data[e:e + 1].isdigit():
                e += 1
            many = rng.choice([b"9" * 5000, b"1" + b"0" * 4400, b"18446744073709551616", b"1" * 400])
            return data[:p] + many + data[e:], f"number at {p} := {len(many)} digits"
    if op == "bom":
        return b"\xef\xbb\xbf" + data, "UTF-8 BOM prepended"
    if op == "nul" and n:
        p = rng.randrange(n)
        return data[:p] + b"\x00" + data[p:], f"NUL inserted at {p}"
    if op == "badutf8" and n:
        p = rng.randrange(n)
        bad = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82"])
        return data[:p] + bad + data[p + 1:], f"invalid UTF-8 {bad!r} at {p}"
    if op == "utf16":
        return data.decode("utf-8", "replace").encode("utf-16"), "re-encoded as UTF-16"
    if op == "surrogate":
        quotes = [i for i in range(n) if data[i:i + 1] == b'"']
        if quotes:
            p = rng.choice(quotes) + 1
            esc = rng.choice([b"\\ud800", b"\\udfff", b"\\ud83d", b"\\u0000"])
            return data[:p] + esc + data[p:], f"{esc.decode()} escape inserted at {p}"
    if op == "header":
        p = rng.randrange(n + 1)
        head = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
                           b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x02", b"\xc7\xff\x03", b"\xc1",
                           b"\xd4\x05\x00", b"\xdc\xff\xff", b"\xd9\x03\xed\xa0\x80"])
        return data[:p] + head + data[p:], f"msgpack header {head!r} inserted at {p}"
    return b"", "emptied"


# -- msgpack mutations -----------------------------------------------------------------------------


class _Ext:
    """A msgpack extension value: ``code`` and its payload (a decoded tree, or raw bytes)."""

    def __init__(self, code: int, inner: Any = None, raw: bytes | None = None) -> None:
        self.code, self.inner, self.raw = code, inner, raw

    def __repr__(self) -> str:
        return f"Ext({self.code}, {self.raw!r})" if self.raw is not None else f"Ext({self.code}, {self.inner!r})"


class _MPRaw(bytes):
    """msgpack bytes written as they are."""


class _MPPairs(list):
    """A msgpack map written pair by pair (duplicate keys allowed)."""


def _mp_decode(data: bytes) -> Any:
    import msgpack

    def hook(code: int, payload: bytes) -> _Ext:
        try:
            return _Ext(code, _mp_decode(payload))
        except Exception:  # noqa: BLE001 - kept as bytes
            return _Ext(code, raw=payload)

    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=hook, use_list=True)


def _mp_encode(v: Any) -> bytes:
    import msgpack
    if isinstance(v, _MPRaw):
        return bytes(v)
    if isinstance(v, _Ext):
        return _pack_ext(v.code, v.raw if v.raw is not None else _mp_encode(v.inner))
    p = msgpack.Packer(use_bin_type=True)
    if isinstance(v, _MPPairs):
        return p.pack_map_header(len(v)) + b"".join(_mp_encode(k) + _mp_encode(x) for k, x in v)
    if isinstance(v, dict):
        return p.pack_map_header(len(v)) + b"".join(_mp_encode(k) + _mp_encode(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return p.pack_array_header(len(v)) + b"".join(_mp_encode(x) for x in v)
    return msgpack.packb(v, use_bin_type=True)


def _pack_ext(code: int, payload: bytes) -> bytes:
    """A msgpack extension value of any code in [-128, 127] (msgpack's ExtType refuses negative ones)."""
    n, c = len(payload), struct.pack("b", code)
    fixed = {1: b"\xd4", 2: b"\xd5", 4: b"\xd6", 8: b"\xd7", 16: b"\xd8"}
    if n in fixed:
        return fixed[n] + c + payload
    if n < 2**8:
        return b"\xc7" + struct.pack(">B", n) + c + payload
    if n < 2**16:
        return b"\xc8" + struct.pack(">H", n) + c + payload
    return b"\xc9" + struct.pack(">I", n) + c + payload


def _deep_ext(depth: int) -> _MPRaw:
    b = b"\xc0"
    for _ in range(depth):
        b = _pack_ext(1, b"\x91" + b)
    return _MPRaw(b)


_EVIL_MP: list[Callable[[], Any]] = [
    lambda: None, lambda: True, lambda: 0, lambda: -1, lambda: 1, lambda: 2**63, lambda: 2**64 - 1,
    lambda: -(2**63), lambda: 0.5, lambda: float("nan"), lambda: float("-inf"), lambda: "", lambda: "x",
    lambda: "\U0001f600", lambda: b"", lambda: b"\x00\xff", lambda: [], lambda: {}, lambda: [None],
    lambda: {"a": 1}, lambda: {1: 2}, lambda: {1.5: 2}, lambda: {None: 0}, lambda: _MPPairs([((1, 2), 3)]),
    lambda: _Ext(3, "123"), lambda: _Ext(3, "-99999999999999999999999"), lambda: _Ext(3, "abc"),
    lambda: _Ext(3, "1_000"), lambda: _Ext(3, " 7 "), lambda: _Ext(3, "9" * 5000), lambda: _Ext(3, 12),
    lambda: _Ext(3, b"12"), lambda: _Ext(3, None), lambda: _Ext(3, "٣"), lambda: _Ext(3, 1.5),
    lambda: _Ext(4, [1.0, 2.0]), lambda: _Ext(4, [1.0]), lambda: _Ext(4, [1.0, 2.0, 3.0]),
    lambda: _Ext(4, ["1", "2"]), lambda: _Ext(4, "12"), lambda: _Ext(4, [True, None]), lambda: _Ext(4, 5),
    lambda: _Ext(4, [1, 2]), lambda: _Ext(4, []), lambda: _Ext(4, ["1+2j", 0.0]),
    lambda: _Ext(1, [1, 2]), lambda: _Ext(1, "abc"), lambda: _Ext(1, 5), lambda: _Ext(1, {"a": 1}),
    lambda: _Ext(1, None), lambda: _Ext(1, b"xy"),
    lambda: _Ext(2, [[1, 2]]), lambda: _Ext(2, [[[1, 2], 3]]), lambda: _Ext(2, [[{}, 1]]),
    lambda: _Ext(2, [[[{}], 1]]), lambda: _Ext(2, [1, 2]), lambda: _Ext(2, "ab"), lambda: _Ext(2, ["ab"]),
    lambda: _Ext(2, [[1, 2, 3]]), lambda: _Ext(2, {"a": 1}), lambda: _Ext(2, [[1, 2], [1, 3]]),
    lambda: _Ext(2, [[None, 1]]), lambda: _Ext(2, [[float("nan"), 1]]), lambda: _Ext(2, [[b"k", 1]]),
    lambda: _Ext(2, None), lambda: _Ext(2, [[[[]], 1]]),
    lambda: _Ext(99, raw=b""), lambda: _Ext(0, raw=b""), lambda: _Ext(-1, raw=b"x"), lambda: _Ext(5, raw=b"\x90"),
    lambda: _Ext(127, raw=b"\xc0"), lambda: _Ext(1, raw=b""), lambda: _Ext(1, raw=b"\xc1"),
    lambda: _Ext(3, raw=b"\xa1"), lambda: _Ext(2, raw=b"\x91\x92\x01"), lambda: _Ext(4, raw=b"\x92\xc0"),
    lambda: _Ext(1, raw=b"\xc0\xc0"), lambda: _Ext(2, raw=b"\x90\x90"), lambda: _Ext(-1, raw=b"\0\0\0\1"),
    lambda: _Ext(-1, raw=b"\0" * 8), lambda: _Ext(-1, raw=b"\xff" * 12), lambda: _Ext(-2, raw=b""),
    lambda: _MPRaw(b"\x91" * 100 + b"\xc0"), lambda: _MPRaw(b"\x91" * 5000 + b"\xc0"),
    lambda: _MPRaw(b"\x81\xa1a" * 3000 + b"\xc0"), lambda: _deep_ext(300), lambda: _deep_ext(3000),
    lambda: _MPRaw(b"\xdd\xff\xff\xff\xff"), lambda: _MPRaw(b"\xdb\xff\xff\xff\xff"),
    lambda: _MPRaw(b"\xc6\xff\xff\xff\xff"), lambda: _MPRaw(b"\xc9\xff\xff\xff\xff\x01"),
    lambda: _MPRaw(b"\xdf\x00\x01\x00\x00"), lambda: _MPRaw(b"\xc1"), lambda: _MPRaw(b"\xd9\x03\xed\xa0\x80"),
    lambda: _MPRaw(b"\xd4\x03\x00"), lambda: _MPRaw(b"\xd7\x04" + b"\x00" * 8),
]


def _mp_paths(v: Any, at: tuple = ()) -> list[tuple]:
    out, stack = [], [(v, at)]
    while stack:
        n, p = stack.pop()
        out.append(p)
        if isinstance(n, (_MPRaw, _MPPairs)):
            continue
        if isinstance(n, _Ext) and n.raw is None:
            stack.append((n.inner, p + ("ext",)))
        elif isinstance(n, dict):
            stack.extend((x, p + (k,)) for k, x in n.items())
        elif isinstance(n, list):
            stack.extend((x, p + (i,)) for i, x in enumerate(n))
    return sorted(out, key=lambda p: [repr(x) for x in p])


def _mp_get(v: Any, path: tuple) -> Any:
    for p in path:
        v = v.inner if isinstance(v, _Ext) and p == "ext" else v[p]
    return v


def _mp_set(root: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    parent = _mp_get(root, path[:-1])
    if isinstance(parent, _Ext):
        parent.inner = new
    else:
        parent[path[-1]] = new
    return root


def mutate_msgpack(rng: random.Random, tree: Any) -> tuple[Any, str]:
    """One mutation of a decoded values tree (see :func:`_mp_decode`)."""
    path = rng.choice(_mp_paths(tree))
    old = _mp_get(tree, path)
    where = "/" + "/".join(repr(p) for p in path)
    op = rng.choices(["replace", "retype", "delete", "duplicate", "ext_code", "wrap", "key"],
                     weights=[8, 3, 2, 2, 2, 1, 2])[0]
    parent = _mp_get(tree, path[:-1]) if path else None
    if op in ("delete", "duplicate") and not isinstance(parent, (list, dict)):
        op = "replace"
    if op == "ext_code" and not isinstance(old, _Ext):
        op = "replace"
    if op == "key" and not (isinstance(parent, dict) and path):
        op = "replace"
    if op == "replace":
        new = rng.choice(_EVIL_MP)()
        return _mp_set(tree, path, new), f"{where} := {_short_mp(new)}"
    if op == "retype":
        if isinstance(old, bool) or old is None:
            new = rng.choice([0, 1, "", None])
        elif isinstance(old, int):
            new = rng.choice([float(old), str(old), _Ext(3, str(old)), [old], old > 0])
        elif isinstance(old, float):
            new = rng.choice([int(old) if math.isfinite(old) else 0, _Ext(4, [old, 0.0]), str(old)])
        elif isinstance(old, str):
            new = rng.choice([old.encode(), [old], _Ext(3, old), _Ext(1, [old])])
        elif isinstance(old, bytes):
            new = rng.choice([old.decode("latin-1"), list(old), _Ext(1, raw=old)])
        elif isinstance(old, list):
            new = rng.choice([_Ext(1, old), {str(i): x for i, x in enumerate(old)}, _Ext(2, old)])
        elif isinstance(old, dict):
            new = rng.choice([list(old.items()), _Ext(2, [[k, x] for k, x in old.items()]), list(old)])
        else:
            new = rng.choice([None, old.inner if old.raw is None else old.raw])
        return _mp_set(tree, path, new), f"{where} := {_short_mp(new)} (retyped)"
    if op == "delete":
        del parent[path[-1]]
        return tree, f"delete {where}"
    if op == "duplicate":
        if isinstance(parent, list):
            parent.insert(path[-1], copy.deepcopy(old))
            return tree, f"duplicate {where}"
        pairs = _MPPairs()
        for k, x in parent.items():
            pairs.append((k, x))
            if k == path[-1]:
                pairs.append((k, copy.deepcopy(x)))
        return _mp_set(tree, path[:-1], pairs), f"duplicate map key {where}"
    if op == "ext_code":
        code = rng.choice([0, 1, 2, 3, 4, 5, 6, -1, -128, 127])
        was, old.code = old.code, code
        return tree, f"{where} extension code {was} -> {code}"
    if op == "wrap":
        new = rng.choice([[old], _Ext(1, [old]), {"k": old}, _Ext(2, [[0, old]])])
        return _mp_set(tree, path, new), f"{where} wrapped as {_short_mp(new)}"
    key = rng.choice([1.0, True, "0", -1, 2**64 - 1, None, b"0", (0,), 0.5])
    items = list(parent.items())
    at = [k for k, _ in items].index(path[-1])
    items[at] = (key, items[at][1])
    return _mp_set(tree, path[:-1], _MPPairs(items)), f"map key {where} := {key!r}"


def _short_mp(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 48 else f"{text[:36]}...<{len(text)} chars>"


# -- shard index mutations -------------------------------------------------------------------------

_MISSING = 2**64 - 1
_U64 = 2**64 - 1


def _crc(data: bytes) -> bytes:
    import crc32c
    return crc32c.crc32c(data).to_bytes(4, "little")


_TAG_MAGIC = b"XCKPLACE"


def _tag(place: bytes, tail: bytes) -> bytes:
    """The place tag (format 1.2) of an object named by ``place`` (generation, NUL, name) whose index and
    index crc32c are ``tail``: ``XCKPLACE``, crc32c(place + tail) u32 LE, 4 zero bytes (spec 4.1)."""
    import crc32c
    return _TAG_MAGIC + crc32c.crc32c(tail, crc32c.crc32c(place)).to_bytes(4, "little") + bytes(4)


def _rebuild(encoded: list[bytes | None], n: int, place: bytes | None) -> bytes:
    """An object from its encoded inner chunks (None: not stored), with a fresh, consistent index (and
    place tag when ``place`` is given)."""
    body, index, off = b"", b"", 0
    for k in range(n):
        e = encoded[k] if k < len(encoded) else None
        if e is None:
            index += struct.pack("<QQ", _MISSING, _MISSING)
        else:
            index += struct.pack("<QQ", off, len(e))
            body += e
            off += len(e)
    tail = index + _crc(index)
    return body + (_tag(place, tail) if place is not None else b"") + tail


_BOMB: dict[str, bytes] = {}


def _zstd_frames() -> dict[str, bytes]:
    """zstd frames that lie: a bomb (64 MiB of zeros), a header claiming 1 TiB, garbage."""
    if not _BOMB:
        import zstandard
        plain = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\0" * (64 << 20))
        sized = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b"\0" * (64 << 20))
        # frame header: magic, descriptor (FCS flag bits 7-6, single segment bit 5), window descriptor
        fhd = plain[4]
        assert fhd >> 6 == 0 and not fhd & 0x20 and not fhd & 0x03, "unexpected zstd frame header"
        lying = plain[:4] + bytes([fhd | 0xC0]) + plain[5:6] + (1 << 40).to_bytes(8, "little") + plain[6:]
        small = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b"\1" * 100)
        _BOMB.update(bomb=plain, bomb_sized=sized, tib_header=lying, small=small,
                     garbage=b"\x28\xb5\x2f\xfd" + bytes(range(40)), empty=b"",
                     skippable=b"\x50\x2a\x4d\x18\x04\x00\x00\x00abcd", two=small + small)
    return _BOMB


def mutate_shard(rng: random.Random, data: bytes, n: int, zstd: bool, place: bytes) -> tuple[bytes, str]:
    """One mutation of a chunk object with ``n`` inner chunks: its index is the last ``16 n + 4`` bytes,
    preceded (format 1.2) by a 16-byte place tag, which is recomputed from ``place`` (generation, NUL,
    object name) whenever the index crc32c is, so the checks behind the tag run too."""
    size = len(data)
    inb = 16 * n + 4
    tagged = size >= inb + 16 and data[size - inb - 16:size - inb - 8] == _TAG_MAGIC
    tag_nbytes = 16 if tagged else 0
    body, raw_index, crc = data[:size - inb - tag_nbytes], data[size - inb:size - 4], data[size - 4:]
    tag = data[size - inb - tag_nbytes:size - inb]
    entries = [list(struct.unpack_from("<QQ", raw_index, 16 * k)) for k in range(n)]
    data_end = len(body)
    op = rng.choices(["field", "missing", "swap", "copy", "shift", "object", "payload", "tag"],
                     weights=[8, 1, 1, 1, 1, 3, 3, 1 if tagged else 0])[0]
    if op in ("swap", "copy") and n < 2:
        op = "field"
    if op == "tag":
        how = rng.choice(["flip", "drop", "magic", "zero_tail", "other_name", "other_generation"])
        if how == "flip":
            p = rng.randrange(8, 12)
            new_tag = tag[:p] + bytes([tag[p] ^ 0x10]) + tag[p + 1:]
        elif how == "drop":
            new_tag = b""
        elif how == "magic":
            new_tag = b"XCKPLACF" + tag[8:]
        elif how == "zero_tail":
            new_tag = tag[:12] + b"\1\0\0\0"
        elif how == "other_name":
            new_tag = _tag(place + b"x", data[size - inb:])
        else:
            new_tag = _tag(b"0" * 32 + place[32:], data[size - inb:])
        return body + new_tag + data[size - inb:], f"place tag: {how}"
    if op == "object":
        how = rng.choice(["truncate", "drop_index_byte", "prepend", "append", "grow_body", "index_only", "empty",
                          "double", "one_byte"])
        if how == "truncate":
            p = rng.randrange(size)
            return data[:p], f"object truncated to {p} of {size} bytes"
        if how == "drop_index_byte":
            return data[:-1], "last byte removed"
        if how == "prepend":
            k = rng.randint(1, 32)
            return b"\0" * k + data, f"{k} zero bytes prepended"
        if how == "append":
            k = rng.randint(1, 32)
            return data + b"\xff" * k, f"{k} bytes appended after the index"
        if how == "grow_body":
            k = rng.randint(1, 64)
            return body + b"\0" * k + data[data_end:], f"{k} bytes inserted before the tag and index"
        if how == "index_only":
            return data[data_end:], "data removed, tag and index kept"
        if how == "empty":
            return b"", "object emptied"
        if how == "double":
            return data + data, "object doubled"
        return b"\0", "object is one byte"
    if op == "payload":
        present = [k for k, (o, nb) in enumerate(entries) if (o, nb) != (_MISSING, _MISSING)]
        if not present or any(o + nb > data_end for o, nb in (entries[k] for k in present)):
            op = "field"
        else:
            k = rng.choice(present)
            o, nb = entries[k]
            enc: list[bytes | None] = [None if (a, b) == (_MISSING, _MISSING) else data[a:a + b]
                                       for a, b in entries]
            payload = data[o:o + nb - 4]
            frames = _zstd_frames()
            choice = rng.choice(["flip", "shorter", "longer", "empty"] + (list(frames) * 2 if zstd else []))
            if choice == "flip" and payload:
                p = rng.randrange(len(payload))
                payload = payload[:p] + bytes([payload[p] ^ 0x5A]) + payload[p + 1:]
            elif choice == "shorter":
                payload = payload[:-1]
            elif choice == "longer":
                payload = payload + b"\0"
            elif choice == "empty":
                payload = b""
            elif choice in frames:
                payload = frames[choice]
            fix = rng.random() < 0.85
            enc[k] = payload + (_crc(payload) if fix else data[o + nb - 4:o + nb])
            what = f"inner chunk {k} payload := {choice} ({len(payload)} bytes)"
            return _rebuild(enc, n, place if tagged else None), what + (
                ", its crc32c and the index rebuilt" if fix else ", old crc32c kept, index rebuilt")
    if op == "field":
        k = rng.randrange(n)
        f = rng.randrange(2)
        cur = entries[k][f]
        others = [e[0] for e in entries]
        new = rng.choice([0, 1, 3, 4, 5, data_end, data_end - 1, data_end + 1, size, size - 4, 2**32, 2**62,
                          2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1, rng.choice(others), rng.choice(others) + 1,
                          (cur + 1) & _U64, (cur - 1) & _U64, (cur + 2**64 - 4) & _U64, rng.randrange(2**64),
                          (_U64 - data_end) & _U64])
        new &= _U64
        entries[k][f] = new
        what = f"entry {k} {'offset' if f == 0 else 'nbytes'} := {new} (was {cur}; data bytes {data_end})"
    elif op == "missing":
        k = rng.randrange(n)
        entries[k] = [_MISSING, rng.choice([_MISSING, 0, 4])]
        what = f"entry {k} := ({_MISSING}, {entries[k][1]})"
    elif op == "swap":
        i, j = rng.sample(range(n), 2)
        entries[i], entries[j] = entries[j], entries[i]
        what = f"entries {i} and {j} swapped"
    elif op == "copy":
        i, j = rng.sample(range(n), 2)
        entries[j] = list(entries[i])
        what = f"entry {j} := entry {i} (overlap)"
    else:
        d = rng.choice([1, -1, 4, -4, 2**63])
        entries = [[(o + d) & _U64 if o != _MISSING else o, nb] for o, nb in entries]
        what = f"every offset shifted by {d}"
    new_index = b"".join(struct.pack("<QQ", o, nb) for o, nb in entries)
    r = rng.random()
    if r < 0.8:
        tail = new_index + _crc(new_index)
        return body + (_tag(place, tail) if tagged else b"") + tail, what + ", index crc32c (and tag) recomputed"
    if r < 0.9:
        return body + tag + new_index + crc, what + ", old index crc32c kept"
    return body + tag + new_index + bytes([crc[0] ^ 1]) + crc[1:], what + ", index crc32c flipped"


# -- bases and cases -------------------------------------------------------------------------------


@dataclass
class Base:
    """One conformance vector: its files (relative path -> bytes) and the parts the targets mutate."""

    name: str
    src: Path
    files: dict[str, bytes]
    zarr_jsons: list[str] = field(default_factory=list)
    orbax_jsons: list[str] = field(default_factory=list)  # _METADATA, _CHECKPOINT_METADATA, _strings.json
    objects: list[tuple[str, int, bool]] = field(default_factory=list)  # (path, inner chunks, zstd)

    @property
    def values(self) -> str | None:
        """The values file, when the vector has one."""
        return "values.msgpack" if "values.msgpack" in self.files else None


def discover(src: Path) -> Base:
    """Walk a checkpoint: every file, every ``zarr.json``, every chunk object with its inner chunk count."""
    files = {p.relative_to(src).as_posix(): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()}
    base = Base(src.parent.name, src, files)
    for rel in files:
        if "/" not in rel and rel.startswith("_"):
            try:
                json.loads(files[rel])
                base.orbax_jsons.append(rel)
            except ValueError:
                pass
    for rel in files:
        if rel != "zarr.json" and not rel.endswith("/zarr.json"):
            continue
        base.zarr_jsons.append(rel)
        meta = json.loads(files[rel])
        if meta.get("node_type") != "array":
            continue
        outer = meta["chunk_grid"]["configuration"]["chunk_shape"]
        codec = next(c for c in meta["codecs"] if c["name"] == "sharding_indexed")["configuration"]
        n = math.prod(o // i for o, i in zip(outer, codec["chunk_shape"]))
        zstd = any(c["name"] == "zstd" for c in codec["codecs"])
        top = rel[:-len("zarr.json")]
        for obj in files:
            if obj == top + "c" or obj.startswith(top + "c/"):
                base.objects.append((obj, n, zstd))
    return base


def bases() -> list[Base]:
    """The conformance vectors, sorted by name."""
    found = [discover(p / "checkpoint") for p in sorted(VALID.iterdir()) if (p / "checkpoint" / "xckpt.json").is_file()]
    assert found, f"no conformance vectors under {VALID}"
    return found


@dataclass
class Case:
    """One mutated checkpoint: which base, the files it replaces (None: deleted) and what was done."""

    number: int
    seed: int
    target: str
    base: str
    files: dict[str, bytes | None]
    mutation: str


def targets() -> list[str]:
    """The target of each case number."""
    return [t for t, k in CASES.items() for _ in range(k)]


def _fix_values(manifest: bytes, blob: bytes) -> bytes:
    """The manifest with its ``values`` size and crc32c those of ``blob``."""
    import crc32c
    doc = json.loads(manifest)
    doc["values"]["size"] = len(blob)
    doc["values"]["crc32c"] = crc32c.crc32c(blob)
    return json.dumps(doc, separators=(",", ":")).encode()


def _consistent(rng: random.Random, base: Base) -> tuple[dict[str, bytes | None], str]:
    """Change one array leaf in the manifest and in its zarr.json alike (shape, chunking, dtype, codec)."""
    from xckpt.format import dtypes, manifest as mf, zarr
    m = mf.parse(base.files["xckpt.json"])
    arrays = [e for e in m.leaves if isinstance(e, mf.ArrayEntry)]
    if not arrays:
        return {}, ""
    i = m.leaves.index(rng.choice(arrays))
    e = m.leaves[i]
    what = rng.choice(["shape", "chunks", "dtype", "compression", "whole"] if e.segments is None and e.shape else
                      ["chunks", "dtype", "compression"])
    big = [0, 1, 2, 7, 2**10, 2**20, 2**24, 2**31, 2**33, 2**40]
    if what == "shape":
        shape = tuple(rng.choice([d] + big) for d in e.shape)
        chunk = tuple(rng.choice([c, max(1, s), 1, 2**20, 2**31]) for c, s in zip(e.chunk_shape, shape))
        inner = tuple(rng.choice([i, c, 1]) if c % i == 0 or rng.random() < 0.2 else c
                      for i, c in zip(e.inner_chunk_shape, chunk))
        new = dataclasses.replace(e, shape=shape, chunk_shape=chunk, inner_chunk_shape=inner)
        desc = f"shape {list(shape)}, chunk_shape {list(chunk)}, inner_chunk_shape {list(inner)}"
    elif what == "whole":  # one object, one inner chunk, of up to 16 GiB: what does a load allocate first?
        shape = (rng.choice([2**27, 2**29, 2**31, 2**32]),) + tuple(e.shape[1:])
        new = dataclasses.replace(e, shape=shape, chunk_shape=shape, inner_chunk_shape=shape)
        desc = f"shape, chunk_shape and inner_chunk_shape {list(shape)}"
    elif what == "chunks":
        def rechunk(shape: tuple, chunk: tuple, inner: tuple) -> tuple[tuple, tuple]:
            c2 = tuple(rng.choice([c, 1, max(1, s), 2**10, 2**20, 2**31, 2**40]) for c, s in zip(chunk, shape))
            i2 = tuple(rng.choice([1, c, i if c % i == 0 else c]) for i, c in zip(inner, c2))
            return c2, i2
        if e.segments is None:
            chunk, inner = rechunk(e.shape, e.chunk_shape, e.inner_chunk_shape)
            new = dataclasses.replace(e, chunk_shape=chunk, inner_chunk_shape=inner)
            desc = f"chunk_shape {list(chunk)}, inner_chunk_shape {list(inner)}"
        else:
            k = rng.randrange(len(e.segments))
            s = e.segments[k]
            chunk, inner = rechunk(s.shape, s.chunk_shape, s.inner_chunk_shape)
            segs = list(e.segments)
            segs[k] = dataclasses.replace(s, chunk_shape=chunk, inner_chunk_shape=inner)
            new = dataclasses.replace(e, segments=tuple(segs))
            desc = f"segment {k}: chunk_shape {list(chunk)}, inner_chunk_shape {list(inner)}"
    elif what == "dtype":
        dtype = rng.choice([d for d in ("bool", "uint8", "int16", "int32", "float64", "complex128", "bfloat16",
                                        "float8_e4m3fn") if d != e.dtype])
        new = dataclasses.replace(e, dtype=dtype, storage_dtype=dtypes.storage_name(dtype))
        desc = f"dtype {dtype}"
    else:
        comp = "zstd" if e.compression == "none" else "none"
        new = dataclasses.replace(e, compression=comp)
        desc = f"compression {comp}"
    m.leaves[i] = new
    files: dict[str, bytes | None] = {"xckpt.json": m.dumps()}
    for a in new.arrays():
        files[f"{a.path}/zarr.json"] = zarr.encode_metadata(
            zarr.zarr_metadata(a.shape, new.storage_dtype, a.chunk_shape, a.inner_chunk_shape, new.compression))
    return files, f"consistent: leaf {new.path!r} {desc} in xckpt.json and zarr.json"


def _json_case(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """1 to 3 JSON or byte mutations of a JSON file."""
    steps = []
    doc = json.loads(data)
    structural = rng.random() < 0.75
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if structural:
            doc, what = mutate_json(rng, doc)
            steps.append(what)
    if structural:
        data = _dump(doc).encode("utf-8", "surrogatepass")
    if not structural or rng.random() < 0.1:
        data, what = mutate_bytes(rng, data, "json")
        steps.append(what)
    return data, "; ".join(steps)


def make_case(number: int, all_bases: list[Base]) -> Case:
    """Case ``number``: deterministic in ``SEED + number`` and the base vectors' bytes."""
    seed = SEED + number
    rng = random.Random(seed)
    target = targets()[number]
    if target == "manifest":
        base = rng.choice(all_bases)
        if rng.random() < 0.2:
            files, what = _consistent(rng, base)
            if files:
                return Case(number, seed, target, base.name, files, what)
        data, what = _json_case(rng, base.files["xckpt.json"])
        return Case(number, seed, target, base.name, {"xckpt.json": data}, what)
    if target == "zarr":
        base = rng.choice([b for b in all_bases if b.zarr_jsons])
        rel = rng.choice(base.zarr_jsons)
        if rng.random() < 0.02:
            return Case(number, seed, target, base.name, {rel: None}, f"{rel} deleted")
        data, what = _json_case(rng, base.files[rel])
        return Case(number, seed, target, base.name, {rel: data}, f"{rel}: {what}")
    if target == "orbax":  # only validate reads these (the Orbax view of the checkpoint)
        base = rng.choice([b for b in all_bases if b.orbax_jsons])
        rel = rng.choice(base.orbax_jsons)
        if rng.random() < 0.05:
            return Case(number, seed, target, base.name, {rel: None}, f"{rel} deleted")
        data, what = _json_case(rng, base.files[rel])
        return Case(number, seed, target, base.name, {rel: data}, f"{rel}: {what}")
    if target == "shard":
        base = rng.choice([b for b in all_bases if b.objects])
        rel, n, zstd = rng.choice(base.objects)
        siblings = [o for o, _, _ in base.objects if o != rel and o.rsplit("/c", 1)[0] == rel.rsplit("/c", 1)[0]]
        if siblings and rng.random() < 0.04:
            other = rng.choice(siblings)
            return Case(number, seed, target, base.name, {rel: base.files[other]}, f"{rel} := a copy of {other}")
        generation = json.loads(base.files["xckpt.json"]).get("generation") or ""
        data, what = mutate_shard(rng, base.files[rel], n, zstd, generation.encode() + b"\0" + rel.encode())
        return Case(number, seed, target, base.name, {rel: data}, f"{rel} ({n} inner chunks): {what}")
    base = rng.choice([b for b in all_bases if b.values])
    blob = base.files["values.msgpack"]
    steps = []
    if rng.random() < 0.65:
        tree = _mp_decode(blob)
        for _ in range(rng.choice([1, 1, 2])):
            tree, what = mutate_msgpack(rng, tree)
            steps.append(what)
        blob = _mp_encode(tree)
    else:
        blob, what = mutate_bytes(rng, blob, "msgpack")
        steps.append(what)
    files: dict[str, bytes | None] = {"values.msgpack": blob}
    if rng.random() < 0.85:
        files["xckpt.json"] = _fix_values(base.files["xckpt.json"], blob)
        steps.append("manifest size and crc32c recomputed")
    return Case(number, seed, target, base.name, files, "values.msgpack: " + "; ".join(steps))


# -- running a case --------------------------------------------------------------------------------


def _frames(tb: Any) -> list[str]:
    out = []
    for f in traceback.extract_tb(tb):
        name = f.filename
        for root in (str(REPO) + os.sep, os.sep + "site-packages" + os.sep):
            if root in name:
                name = name.split(root, 1)[1]
        out.append(f"{name}:{f.lineno}:{f.name}")
    return out


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out and len(out) < 20:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _declared(exc: BaseException) -> bool:
    """Whether ``exc`` refuses the memory of an array a load returns, of the size its checkpoint declares:
    ``resource.too_large`` whose MemoryError the engine's allocation of a loaded array raised."""
    from xckpt.errors import XckptError
    if not isinstance(exc, XckptError) or exc.code != "resource.too_large":
        return False
    memory = [e for e in _chain(exc) if isinstance(e, MemoryError)]
    return all(_frames(e.__traceback__)[-1:] and _frames(e.__traceback__)[-1].startswith("xckpt/engine/read.py:")
               and _frames(e.__traceback__)[-1].endswith(":empty") for e in memory)


def _failure(case: Case, op: str, kind: str, exc: BaseException | None, detail: str = "",
             where: list[str] | None = None) -> dict[str, Any]:
    frames = _frames(exc.__traceback__) if exc is not None else []
    inner = where or [f.rsplit(":", 2)[0] + ":" + f.rsplit(":", 1)[1] for f in frames if f.startswith("xckpt/")][-4:]
    chain = " <- ".join(f"{type(e).__name__}: {str(e)[:200]}" for e in _chain(exc)) if exc is not None else detail
    return {"seed": case.seed, "number": case.number, "target": case.target, "base": case.base,
            "files": sorted(case.files), "mutation": case.mutation[:600], "op": op, "kind": kind,
            "exc": type(exc).__name__ if exc is not None else kind, "message": chain[:800],
            "where": inner[::-1], "frames": frames[-8:]}


class Hang(BaseException):
    """Raised in the case's thread by SIGALRM when the case runs past :data:`CASE_TIMEOUT` (a
    BaseException, so that no ``except Exception`` in the code under test swallows it)."""


def _alarm(signum: int, frame: Any) -> None:
    raise Hang(f"no result within {CASE_TIMEOUT} s")


def run_case(path: str, case: Case) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """inspect, load and deep validate one mutated checkpoint; their outcomes and the failures.

    After a :class:`Hang` the remaining calls are skipped."""
    import xckpt
    from xckpt.errors import XckptError
    outcomes: dict[str, str] = {}
    failures: list[dict[str, Any]] = []
    calls: list[tuple[str, Callable[[], Any]]] = [("inspect", lambda: xckpt.inspect(path)),
                                                  ("load", lambda: xckpt.load(path)),
                                                  ("validate", lambda: xckpt.validate(path, deep=True))]
    for op, call in calls:
        try:
            result = call()
            if op == "validate":
                bad = [f for f in result.findings if not (isinstance(f.code, str) and f.code)]
                if bad:
                    failures.append(_failure(case, op, "empty-code", None, f"finding without a code: {bad[0]}"))
                json.dumps(result.to_json())
                errors = sorted({f.code for f in result.findings if f.severity == "error"})
                outcomes[op] = ",".join(errors) if errors else "ok"
            else:
                json.dumps(result, default=repr) if op == "inspect" else None
                outcomes[op] = "ok"
        except Hang as exc:
            outcomes[op] = "hang"
            failures.append(_failure(case, op, "hang", exc))
            break
        except XckptError as exc:
            outcomes[op] = f"raised {exc.code}"
            if any(isinstance(e, Hang) for e in _chain(exc)):
                failures.append(_failure(case, op, "hang", exc))
                break
            if op == "validate":
                failures.append(_failure(case, op, "validate-raised", exc))
            elif any(isinstance(e, MemoryError) for e in _chain(exc)) and not _declared(exc):
                failures.append(_failure(case, op, "memory", exc))
            elif not (isinstance(exc.code, str) and exc.code):
                failures.append(_failure(case, op, "empty-code", exc))
            else:
                str(exc), json.dumps(exc.to_json())
        except MemoryError as exc:
            outcomes[op] = "MemoryError"
            failures.append(_failure(case, op, "memory", exc))
        except Exception as exc:  # noqa: BLE001 - what the fuzz is looking for
            outcomes[op] = type(exc).__name__
            failures.append(_failure(case, op, "validate-raised" if op == "validate" else "exception", exc))
    load = outcomes.get("load", "")
    if load.startswith("raised ") and load[7:] not in NOT_DEFECTS and outcomes.get("validate") == "ok":
        failures.append(_failure(case, "validate", "validate-missed", None,
                                 f"load raised {load[7:]}, deep validation found no error", [f"load:{load[7:]}"]))
    return outcomes, failures


def _apply(root: Path, files: dict[str, bytes | None]) -> None:
    for rel, data in files.items():
        p = root / rel
        if data is None:
            p.unlink(missing_ok=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def child(workdir: Path, worker: int, workers: int, start: int, progress: Path) -> None:
    """Run this worker's cases from position ``start``; print a JSON summary line at the end."""
    import faulthandler
    import resource

    warnings.simplefilter("ignore")
    import numpy  # noqa: F401 - in the baseline
    import tensorstore  # noqa: F401 - its threads reserve address space: in the baseline
    import xckpt

    all_bases = bases()
    roots = {}
    for b in all_bases:
        roots[b.name] = workdir / f"w{worker}" / b.name
        shutil.rmtree(roots[b.name], ignore_errors=True)
        shutil.copytree(b.src, roots[b.name])
        xckpt.inspect(roots[b.name])
        xckpt.load(roots[b.name])
        report = xckpt.validate(roots[b.name], deep=True)
        assert report.ok, f"base vector {b.name} does not validate: {[str(f) for f in report.findings]}"
    _zstd_frames()
    mine = list(range(len(targets())))[worker::workers]
    make_case(mine[start], all_bases) if start < len(mine) else None  # warm the generators
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    limit = _vm_size() + HEADROOM
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:  # the cap must work, or no case could show an allocation beyond it
        bytearray(HEADROOM + (64 << 20))
        raise SystemExit(f"fuzz child: allocating {HEADROOM >> 20} MiB succeeded under the address-space cap")
    except MemoryError:
        pass
    signal.signal(signal.SIGALRM, _alarm)
    cases: Counter = Counter()
    outcomes: dict[str, Counter] = {}
    failures: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with open(progress, "a") as log:
        for pos in range(start, len(mine)):
            case = make_case(mine[pos], all_bases)
            log.write(json.dumps({"begin": pos, "case": dataclasses.asdict(case) | {"files": sorted(case.files)}})
                      + "\n")
            log.flush()
            root = roots[case.base]
            _apply(root, case.files)
            signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT)  # a Python-level hang: Hang, a traceback
            faulthandler.dump_traceback_later(CASE_TIMEOUT + 5, exit=True)  # one in C code: exit, a dump
            try:
                got, bad = run_case(str(root), case)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                faulthandler.cancel_dump_traceback_later()
            base = next(b for b in all_bases if b.name == case.base)
            _apply(root, {rel: base.files.get(rel) for rel in case.files})
            cases[case.target] += 1
            for op, o in got.items():
                outcomes.setdefault(f"{case.target}/{op}", Counter())[o] += 1
            failures += bad
            log.write(json.dumps({"end": pos, "target": case.target, "outcomes": got, "failures": bad}) + "\n")
            log.flush()
    print(json.dumps({"worker": worker, "start": start, "cases": cases, "outcomes": outcomes, "failures": failures,
                      "seconds": round(time.monotonic() - t0, 1), "address_space_limit": limit}))


# -- the test --------------------------------------------------------------------------------------


def _hang_frames(stderr: str) -> tuple[list[str], list[str]]:
    """From a faulthandler dump: the innermost xckpt frames of the thread running the case, and all its
    frames (outermost first)."""
    blocks: list[list[str]] = []
    for line in stderr.splitlines():
        line = line.strip()
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        elif line.startswith("File ") and blocks:
            path = line.split('"')[1].split(str(REPO) + os.sep, 1)[-1]
            blocks[-1].append(f"{path}:{line.split(', line ')[-1].split(' ')[0]}:{line.rsplit(' in ', 1)[-1]}")
    block = next((b for b in blocks if any("test_fuzz.py" in f for f in b)), blocks[0] if blocks else [])
    where = [f.rsplit(":", 2)[0] + ":" + f.rsplit(":", 1)[1] for f in block if f.startswith("xckpt/")]
    return where[:4], block[::-1]


def _run_worker(workdir: Path, worker: int, workers: int) -> dict[str, Any]:
    """One worker's cases, restarting its child after a case that ended it."""
    merged: dict[str, Any] = {"cases": Counter(), "outcomes": {}, "failures": [], "seconds": 0.0, "runs": 0}
    progress = workdir / f"progress{worker}.jsonl"
    env = dict(os.environ, MALLOC_ARENA_MAX="2", PYTHONHASHSEED="0",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    start, total = 0, len(list(range(len(targets())))[worker::workers])
    while start < total:
        merged["runs"] += 1
        progress.write_text("")
        proc = subprocess.run([sys.executable, __file__, "--child", str(workdir), str(worker), str(workers),
                               str(start), str(progress)], capture_output=True, text=True, env=env,
                              timeout=120 + total * CASE_TIMEOUT // 20)
        summary = None
        for line in proc.stdout.splitlines()[::-1]:
            if line.startswith('{"worker"'):
                summary = json.loads(line)
                break
        events = [json.loads(x) for x in progress.read_text().splitlines() if x.strip()]
        for e in events:
            if "end" in e:
                merged["cases"][e["target"]] += 1
                for op, o in e["outcomes"].items():
                    merged["outcomes"].setdefault(f"{e['target']}/{op}", Counter())[o] += 1
                merged["failures"] += e["failures"]
        if summary is not None:
            merged["seconds"] += summary["seconds"]
            merged["address_space_limit"] = summary["address_space_limit"]
        if proc.returncode == 0 and summary is not None:
            break
        begun = [e for e in events if "begin" in e]
        ended = {e["end"] for e in events if "end" in e}
        open_cases = [e for e in begun if e["begin"] not in ended]
        if not open_cases:
            raise AssertionError(f"fuzz worker {worker} failed outside any case (rc {proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        # the child died in a case: count it, report it, go on after it
        info = open_cases[-1]
        c = info["case"]
        hang = "Timeout (" in proc.stderr
        where, frames = _hang_frames(proc.stderr)
        merged["cases"][c["target"]] += 1
        op = next((name for name in ("inspect", "load", "validate") if f"xckpt/{name}.py:" in "".join(frames)), "?")
        merged["failures"].append({
            "seed": c["seed"], "number": c["number"], "target": c["target"], "base": c["base"], "files": c["files"],
            "mutation": c["mutation"][:600], "op": op, "kind": "hang" if hang else "crash",
            "exc": "hang" if hang else f"rc {proc.returncode}",
            "message": (f"no result within {CASE_TIMEOUT} s" if hang else f"child exited with {proc.returncode}"),
            "where": where, "frames": frames or [proc.stderr[-1500:]]})
        start = info["begin"] + 1
        if merged["runs"] > MAX_RESTARTS:
            raise AssertionError(f"fuzz worker {worker}: more than {MAX_RESTARTS} cases crashed or hung; "
                                 f"last:\n{json.dumps(merged['failures'][-1], indent=1)}")
    return merged


def _describe(f: dict[str, Any]) -> str:
    return (f"seed {f['seed']} [{f['target']} of {f['base']}] {f['op']}: {f['kind']} {f['exc']}\n"
            f"    files: {', '.join(f['files'])}\n    mutation: {f['mutation']}\n    error: {f['message'][:400]}\n"
            f"    at: {' <- '.join(f['frames'][-5:][::-1])[:900]}")


def test_fuzz(tmp_path: Path) -> None:
    """1,000+ seeded mutations: only XckptError escapes, validate never raises, no hang, no 1 GiB allocation."""
    t0 = time.monotonic()
    results: list[dict[str, Any]] = [{}] * WORKERS
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            results[w] = _run_worker(tmp_path, w, WORKERS)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    cases: Counter = Counter()
    outcomes: dict[str, Counter] = {}
    failures: list[dict[str, Any]] = []
    for r in results:
        cases.update(r["cases"])
        for k, c in r["outcomes"].items():
            outcomes.setdefault(k, Counter()).update(c)
        failures += r["failures"]
    failures.sort(key=lambda f: (f["seed"], f["op"]))
    elapsed = time.monotonic() - t0
    print(f"fuzz: {sum(cases.values())} cases {dict(cases)} in {elapsed:.1f} s on {WORKERS} workers "
          f"(address space limit {results[0].get('address_space_limit', 0) >> 20} MiB)")
    for k in sorted(outcomes):
        print(f"  {k}: {dict(outcomes[k].most_common(8))}")
    known = [(f, next((k for k in KNOWN if k.matches(f)), None)) for f in failures]
    unknown = [f for f, k in known if k is None]
    for f, k in known:
        print(("KNOWN (" + k.todo.split(":")[0] + ") " if k else "FAIL ") + _describe(f))
    stale = [k for k in KNOWN if not any(m is k for _, m in known)]
    if stale:
        warnings.warn(f"fuzz: no case hits these marks any more, remove them: {[k.todo for k in stale]}")
    assert sum(cases.values()) == len(targets()) >= 1000, cases
    assert all(cases[t] == n for t, n in CASES.items()), cases
    if unknown:
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for f in unknown:
            groups.setdefault((f["kind"], f["exc"], tuple(f["where"][:1])), []).append(f)
        lines = [f"{len(unknown)} fuzz failures in {len(groups)} groups (every case is printed above):"]
        for (kind, exc, where), fs in sorted(groups.items(), key=lambda g: -len(g[1])):
            lines.append(f"* {len(fs)} x {kind} {exc} at {where[0] if where else '?'} "
                         f"(seeds {[f['seed'] for f in fs[:6]]})\n  " + _describe(fs[0]).replace("\n", "\n  "))
        raise AssertionError("\n".join(lines))


def test_values_decoding_found_by_fuzz() -> None:
    """What the fuzz found in values.msgpack decoding: each is a ``values.invalid``, nothing else escapes,
    and deep nesting never recurses on the C stack (one nested unpack took ~40 KB of it: 200 levels
    crashed the process)."""
    import msgpack

    from xckpt.errors import XckptError
    from xckpt.format import values

    def refused(raw: bytes) -> str:
        try:
            got = values.decode(raw)
        except XckptError as exc:
            return exc.code
        return f"accepted {got!r}"[:80]

    bad = {
        "deep extensions": bytes(_deep_ext(3000)), "67 nested extensions": bytes(_deep_ext(67)),
        "timestamp": b"\x91\xd6\xff\x00\x00\x00\x01", "unknown extension": _pack_ext(7, b"\xc0"),
        "bigint in 64 bits": _pack_ext(3, msgpack.packb("12")), "bigint --5": _pack_ext(3, msgpack.packb("--5")),
        "bigint 1_0": _pack_ext(3, msgpack.packb("1" * 20 + "_0")),
        "bigint arabic digits": _pack_ext(3, msgpack.packb("\u0663" * 20)),
        "bigint 5000 digits": _pack_ext(3, msgpack.packb("9" * 5000)),
        "bigint not str": _pack_ext(3, msgpack.packb(12)),
        "complex of ints": _pack_ext(4, msgpack.packb([1, 2])),
        "complex of 3": _pack_ext(4, msgpack.packb([1.0] * 3)),
        "tuple of str": _pack_ext(1, msgpack.packb("abc")), "dict of str": _pack_ext(2, msgpack.packb(["ab"])),
        "dict key twice": _pack_ext(2, msgpack.packb([[1, 0], [True, 1]])), "dict key a map": _pack_ext(
            2, msgpack.packb([[{}, 1]])), "map key int": b"\x81\x01\x02", "map key twice": b"\x82\xa1a\x01\xa1a\x02",
        "map key bytes": b"\x81\xc4\x01a\x02", "truncated": b"\x92\x01", "extra bytes": b"\xc0\xc0", "empty": b"",
        "never used byte": b"\xc1", "array claiming 2**32": b"\xdd\xff\xff\xff\xff",
        "invalid UTF-8": b"\xa3\xed\xa0\x80",
    }
    result: dict[str, str] = {}

    def run() -> None:
        result.update({name: refused(raw) for name, raw in bad.items()})

    old = threading.stack_size(256 << 10)  # as little stack as a small thread may have
    try:
        t = threading.Thread(target=run)
        t.start()
    finally:
        threading.stack_size(old)
    t.join()
    assert result == {name: "values.invalid" for name in bad}, result
    deep: Any = 1j
    for _ in range(63):
        deep = (deep,)
    tree = {0: None, 1: [True, 2**64 - 1, -(2**63)], 2: 10**400, 3: -(10**30), (4, 5): {"a": b"x", "b": (1.5, 2j)},
            6: {(1, (2,)): "k", None: 0, 1.5: []}, 7: deep}
    again = values.decode(values.encode(tree))
    assert again == tree and repr(again) == repr(tree)
    for value in (((deep,),), {0: (deep,)}, 10**5000):
        try:
            values.encode(value)
            raise AssertionError("encoded a value that decoding refuses")
        except XckptError as exc:
            assert exc.code == "value.unsupported"


def test_zarr_json_checks_found_by_fuzz() -> None:
    """What the fuzz found in zarr.json checking: numbers of 5000 digits and deep nesting (ValueError and
    RecursionError escaped) and readings that other Zarr readers may not share (UTF-16, a BOM, a member
    twice, a float for an integer) are all refused with a short message; defaults still compare equal."""
    from xckpt.format import zarr

    expected = zarr.zarr_metadata([2, 3], "float32", [2, 3], [1, 3], "zstd")
    ok = zarr.encode_metadata(expected)
    assert zarr.check_metadata(ok, expected) is None
    same = json.loads(ok)
    del same["codecs"][0]["configuration"]["index_location"]
    same["fill_value"] = 0
    assert zarr.check_metadata(json.dumps(same, indent=1).encode(), expected) is None
    shape = b'"shape":[2,3]'
    assert shape in ok
    bad = {
        "float dimension": ok.replace(shape, b'"shape":[2.0,3]'),
        "bool fill": ok.replace(b'"fill_value":0.0', b'"fill_value":false'),
        "5000 digits": ok.replace(shape, b'"shape":[' + b"1" * 5000 + b"]"),
        "nested 900": ok.replace(shape, b'"shape":' + b"[" * 900 + b"]" * 900),
        "nested 5000": ok.replace(shape, b'"shape":' + b"[" * 5000 + b"]" * 5000),
        "objects 900": ok.replace(b'"chunk_key_encoding":', b'"chunk_key_encoding":' + b'{"a":' * 900 + b"0"
                                  + b"}" * 900 + b',"x":'),
        "member twice": ok.replace(shape, shape + b"," + shape),
        "BOM": b"\xef\xbb\xbf" + ok, "UTF-16": ok.decode().encode("utf-16"),
        "lone surrogate": ok.replace(b'"default"', b'"\\ud800"'), "not an object": b"[]",
    }
    for name, raw in bad.items():
        why = zarr.check_metadata(raw, expected)
        assert why is not None and len(why) < 400, (name, why)


def _repro(seed: int, keep: str | None) -> None:
    warnings.simplefilter("ignore")
    all_bases = bases()
    case = make_case(seed - SEED, all_bases)
    print(f"seed {seed}: {case.target} of {case.base}\n  {case.mutation}")
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="xckpt-fuzz-"))
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(next(b for b in all_bases if b.name == case.base).src, root)
    _apply(root, case.files)
    import xckpt
    for op, call in [("inspect", lambda: xckpt.inspect(str(root))), ("load", lambda: xckpt.load(str(root))),
                     ("validate", lambda: xckpt.validate(str(root), deep=True))]:
        try:
            out = call()
            print(f"{op}: ok" + (f" {[str(f) for f in out.findings]}" if op == "validate" else ""))
        except BaseException:  # noqa: BLE001 - shown
            print(f"{op}: raised")
            traceback.print_exc()
    print(f"checkpoint: {root}" if keep else "")
    if not keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
    elif sys.argv[1] == "--repro":
        _repro(int(sys.argv[2]), sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--keep" else None)
    else:
        sys.exit("usage: test_fuzz.py --repro SEED [--keep DIR]")
