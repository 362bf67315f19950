"""Orbax's ``_METADATA``: its records, and the tree they describe (keys, containers, rich types)."""

from __future__ import annotations

import ast
import json
import keyword
import re
from dataclasses import dataclass
from typing import Any


from xckpt.format import names as naming
from xckpt.format.orbax_view import KEY_DICT, KEY_SEQUENCE
from xckpt.errors import ManifestError, UnsafePathError, UnsupportedError
from xckpt.format.jsonobj import is_unicode, parse_json
from xckpt.format.tree import MAX_DEPTH, Key, Node, key_str


OCDBT_MANIFEST = "manifest.ocdbt"
#: Orbax's ``key_type`` of a sequence index and of a dict key.


EMPTY_TYPES = {"Dict": "dict", "List": "list", "Tuple": "tuple", "NamedTuple": "namedtuple"}


#: Orbax records without data that xckpt reads as None (``placeholder`` is Orbax's ``...``).
NONE_TYPES = ("None", "placeholder")


#: A sequence index: a decimal integer without leading zeros, of at most 18 digits (so ``int`` always takes it,
#: and no longer one could be an index of a list that fits in memory).
_INDEX = re.compile(r"^(0|[1-9][0-9]{0,17})$")


@dataclass
class Record:
    """One entry of ``_METADATA``'s ``tree_metadata``."""

    key: Key
    name: str
    value_type: str
    skip: bool
    write_shape: list[int] | None


def parse_metadata(raw: bytes, file: str) -> dict[str, Any]:
    """Parse Orbax's ``_METADATA`` JSON; reject anything without a ``tree_metadata`` object.

    Not UTF-8, not JSON, a number beyond Python's digit limit, nesting too deep to parse or a lone surrogate
    (:func:`~xckpt.format.jsonobj.parse_json`): ``orbax.invalid``.
    """
    meta = parse_json(raw, "_METADATA", code="orbax.invalid", file=file)
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise ManifestError("_METADATA is not an object with a tree_metadata object", code="orbax.invalid",
                            file=file)
    return meta


def parse_flag(obj: dict[str, Any], name: str, file: str, leaf: str | None = None, *,
               unset: bool | None = False) -> bool | None:
    """The boolean member ``name`` of ``obj`` (``unset`` when it is missing or null); anything else, such as
    the string ``"false"`` (which ``bool()`` would take for true), is ``orbax.invalid``."""
    value = obj.get(name)
    if value is None:
        return unset
    if not isinstance(value, bool):
        raise ManifestError(f"{name} is {value!r:.100}, not a boolean", code="orbax.invalid", file=file, leaf=leaf)
    return value


def read_records(meta: dict[str, Any], file: str) -> list[Record]:
    """One checked :class:`Record` per entry of ``tree_metadata``."""
    out = []
    for tree_key, rec in meta["tree_metadata"].items():
        if not isinstance(rec, dict) or not isinstance(rec.get("value_metadata"), dict):
            raise ManifestError(f"record {tree_key} has no value_metadata object", code="orbax.invalid",
                                file=file, leaf=tree_key)
        parts = _key_parts(tree_key, rec.get("key_metadata"), file)
        if not parts:
            raise UnsupportedError("a bare leaf at the root of the tree is not supported", file=file)
        key = tuple(int(k) if t == KEY_SEQUENCE else k for k, t in parts)
        _check_depth(key, file)
        vm = rec["value_metadata"]
        value_type = vm.get("value_type")
        if not isinstance(value_type, str):
            raise ManifestError(f"value_type is {value_type!r}, not a string", code="orbax.invalid",
                                file=file, leaf=key_str(key))
        ws = vm.get("write_shape")
        out.append(Record(key, ".".join(k for k, _ in parts), value_type,
                          bool(parse_flag(vm, "skip_deserialize", file, key_str(key))),
                           list(ws) if isinstance(ws, list) else None))
    return out


def _check_depth(key: Key, file: str) -> None:
    """A key has at most :data:`MAX_DEPTH` parts (xckpt's trees nest no deeper): ``orbax.tree``."""
    if len(key) > MAX_DEPTH:
        raise ManifestError(f"key of {len(key)} parts: a tree nests at most {MAX_DEPTH} levels deep",
                            code="orbax.tree", file=file, leaf=key_str(key[:MAX_DEPTH]) + "/...")


def _key_parts(tree_key: str, km: Any, file: str) -> list[tuple[str, int]]:
    """``[(key, key_type), ...]`` of a record; old files without key_metadata hold dict keys only."""
    if km is None:
        try:
            parsed = ast.literal_eval(tree_key)
        except (ValueError, SyntaxError, RecursionError, MemoryError):  # the last two: nesting too deep
            raise ManifestError(f"record key {tree_key[:200]!r} is not a tuple and has no key_metadata",
                                code="orbax.invalid", file=file) from None
        if not isinstance(parsed, tuple):
            raise ManifestError(f"record key {tree_key!r} is not a tuple", code="orbax.invalid", file=file)
        parts = [str(k) for k in parsed]
        if not all(is_unicode(k) for k in parts):  # a '\\ud800' escape in the tuple's text
            raise ManifestError(f"record key {tree_key!r} holds a string that is not valid Unicode (a lone "
                                "surrogate)", code="orbax.invalid", file=file)
        return [(k, KEY_DICT) for k in parts]
    if not isinstance(km, list):
        raise ManifestError(f"key_metadata of {tree_key} is not a list", code="orbax.invalid", file=file,
                            leaf=tree_key)
    parts = []
    for k in km:
        if not isinstance(k, dict) or not isinstance(k.get("key"), str) or \
                type(k.get("key_type")) is not int or k["key_type"] not in (KEY_SEQUENCE, KEY_DICT):  # not True, 2.0
            raise ManifestError(f"key_metadata entry {k!r} of {tree_key} needs a str key and key_type 1 or 2",
                                code="orbax.invalid", file=file, leaf=tree_key)
        if k["key_type"] == KEY_SEQUENCE and not _INDEX.match(k["key"]):
            raise ManifestError(f"sequence key {k['key'][:100]!r} of {tree_key} is not an index",
                                code="orbax.invalid", file=file, leaf=tree_key)
        parts.append((k["key"], k["key_type"]))
    return parts


def _new_node() -> dict[str, Any]:
    return {"kind": None, "children": {}}


def build_tree(records: list[Record], file: str) -> dict[str, Any]:
    """Nest the records into containers, checking that each path is used one way only.

    The records come from :func:`read_records`, whose keys are at most :data:`MAX_DEPTH` parts long, so every
    walk of the tree built here stays shallow.
    """
    root = _new_node()
    for rec in records:
        node = root
        for depth, part in enumerate(rec.key):
            kind = "list" if isinstance(part, int) else "dict"
            where = key_str(rec.key[:depth])
            if node["kind"] is None:
                node["kind"] = kind
            elif node["kind"] != kind:
                raise ManifestError(f"{where} is used both as a {node['kind']} and as a {kind}",
                                    code="orbax.tree", file=file, leaf=key_str(rec.key))
            children = node["children"]
            if depth == len(rec.key) - 1:
                if part in children:
                    raise ManifestError("two records give this leaf, or it is also a container",
                                        code="orbax.tree", file=file, leaf=key_str(rec.key))
                children[part] = {"kind": "leaf", "record": rec}
            else:
                child = children.setdefault(part, _new_node())
                if child["kind"] == "leaf":
                    raise ManifestError(f"{key_str(rec.key[:depth + 1])} is both a leaf and a container",
                                        code="orbax.tree", file=file, leaf=key_str(rec.key))
                node = child
    if root["kind"] is None:
        root["kind"] = "dict"
    _check_sequences(root, (), file)
    return root


def _check_sequences(node: dict[str, Any], key: Key, file: str) -> None:
    if node["kind"] == "leaf":
        return
    if node["kind"] == "list" and sorted(node["children"]) != list(range(len(node["children"]))):
        raise ManifestError(f"sequence indices {sorted(node['children'])} are not 0..n-1",
                            code="orbax.tree", file=file, leaf=key_str(key))
    for k, child in node["children"].items():
        _check_sequences(child, key + (k,), file)


def _is_rich(obj: Any, category: str | None = None) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("clazz"), str) and \
        obj.get("category") in ((category,) if category else ("custom", "namedtuple"))


def apply_rich_types(root: dict[str, Any], text: Any) -> None:
    """Mark tuples and namedtuples recorded in Orbax's optional rich ``value_metadata_tree``.

    Best effort: when that tree does not match the records, it is ignored (lists and dicts stay).
    """
    if not isinstance(text, str):
        return
    try:
        rich = json.loads(text)
        marks: list[tuple[dict[str, Any], dict[str, Any]]] = []
        _match_rich(root, rich, marks)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return
    for node, change in marks:
        node.update(change)


def _valid_namedtuple(name: str, fields: list[Any]) -> bool:
    return all(isinstance(f, str) and f.isidentifier() and not keyword.iskeyword(f) and not f.startswith("_")
               for f in fields + [name]) and len(set(fields)) == len(fields)


def _match_rich(node: dict[str, Any], rich: Any, marks: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    if node["kind"] == "leaf":
        return
    children = node["children"]
    if _is_rich(rich, "namedtuple"):
        fields = [e["key"] for e in rich["entries"]]
        if node["kind"] != "dict" or set(fields) != set(children) or not _valid_namedtuple(rich["clazz"], fields):
            raise ValueError("namedtuple does not match")
        for e in rich["entries"]:
            _match_rich(children[e["key"]], e["value"], marks)
        marks.append((node, {"kind": "namedtuple", "name": rich["clazz"], "fields": fields}))
    elif _is_rich(rich, "custom") and rich["clazz"] == "tuple":
        if node["kind"] != "list" or len(rich["entries"]) != len(children):
            raise ValueError("tuple does not match")
        for i, sub in enumerate(rich["entries"]):
            _match_rich(children[i], sub, marks)
        marks.append((node, {"kind": "tuple"}))
    elif isinstance(rich, list) and node["kind"] == "list" and len(rich) == len(children):
        for i, sub in enumerate(rich):
            _match_rich(children[i], sub, marks)
    elif isinstance(rich, dict) and not _is_rich(rich) and node["kind"] == "dict" and set(rich) == set(children):
        for k, sub in rich.items():
            _match_rich(children[k], sub, marks)
    else:
        raise ValueError("structure does not match")


def finish(node: dict[str, Any], key: Key) -> tuple[Node, list[Record]]:
    """The JSON tree of xckpt and the data-bearing records in leaf order.

    ``node`` comes from :func:`build_tree`, so the recursion is at most :data:`MAX_DEPTH` deep.
    """
    ordered: list[Record] = []

    def walk(n: dict[str, Any], k: Key) -> Node:
        kind = n["kind"]
        if kind == "leaf":
            rec: Record = n["record"]
            empty = EMPTY_TYPES.get(rec.value_type) if rec.skip else None
            if empty == "namedtuple":
                return {"kind": "namedtuple", "name": "EmptyNamedTuple", "fields": [], "items": []}
            if empty is not None:
                return {"kind": empty, "items": []}
            ordered.append(rec)
            return {"kind": "leaf", "index": len(ordered) - 1}
        children = n["children"]
        if kind == "dict":
            return {"kind": "dict", "items": [[c, walk(children[c], k + (c,))] for c in children]}
        if kind == "namedtuple":
            return {"kind": "namedtuple", "name": n["name"], "fields": list(n["fields"]),
                    "items": [walk(children[f], k + (f,)) for f in n["fields"]]}
        return {"kind": kind, "items": [walk(children[i], k + (i,)) for i in range(len(children))]}

    return walk(node, key), ordered


def check_names(records: list[Record], file: str) -> None:
    """Array names must stay inside the checkpoint and be distinct, before any is read.

    A name may hold ``/`` (a dict key such as Haiku's ``mlp/~/linear_0``: Orbax stores the array in nested
    directories) when every part of it is a plain name (no ``..``, ``.`` or empty part) and the first part
    is not one of the checkpoint's own files.
    """
    seen: dict[str, Key] = {}
    for rec in records:
        leaf = key_str(rec.key)
        naming.check_relative(rec.name, file=file, leaf=leaf, bounded=False)
        if rec.name.split("/", 1)[0] in naming.RESERVED:
            raise UnsafePathError(f"array name {rec.name!r} is (or is below) a reserved name",
                                  file=file, leaf=leaf)
        if rec.name in seen:
            raise ManifestError(f"leaves {key_str(seen[rec.name])!r} and {leaf!r} are both stored as "
                                f"{rec.name!r}", code="manifest.path_collision", file=file, leaf=leaf)
        seen[rec.name] = rec.key
