"""The collective save protocol: describe, plan, write, commit.

1. :func:`prepare` (collective): flatten the tree, describe every leaf, agree on a plan.
   Every process sends a 16-byte digest of its descriptors to the coordinating process,
   which checks the target and either reuses the plan of an identical earlier save or asks
   one process per distinct digest for its descriptors, plans, and answers each process.
2. :func:`write` (no collective): this process writes its chunk objects and the
   ``zarr.json`` of the arrays whose first chunk it writes.
3. :func:`commit` (collective): every process reports how its writes went (and its
   values); the coordinating process writes the values, the Orbax view, the manifest and
   the commit marker, and moves the checkpoint into place.

Every step that exchanges messages goes through :mod:`xckpt.engine.collective`, so a
failure anywhere fails the save on every process with every failing rank's error.
An asynchronous save runs step 2 and the coordinating process's part of step 3 in the
background (:mod:`xckpt.engine.background`).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from xckpt import registry
from xckpt.engine import collective
from xckpt.engine.collective import Coordinator
from xckpt.engine import failpoints
from xckpt.engine.claims import new_generation
from xckpt.engine.commit import (Hold, SaveOptions, array_metadata, check_target, commit_failed, discard, publish,
                                 write_commit_files, write_marker)
from xckpt.engine.plan import Descriptors, GlobalPlan, LeafDesc, LocalPlan, digest, local_plan, plan_save
from xckpt.engine.storage import Location
from xckpt.engine.write import ChunkWriter
from xckpt.errors import CollectiveError, CoordinationError, SaveError, TreeError, XckptError, XckptWarning
from xckpt.format import dtypes, shard, values as values_format, zarr
from xckpt.format.manifest import Manifest
from xckpt.format.regions import Region
from xckpt.format.tree import Value, flatten, key_str
from xckpt.registry import ArraySource, Shard

_SCALARS = (bool, int, float, complex, str, bytes, type(None))
#: Plans kept for reuse by later saves of the same structure (per process).
_PLAN_CACHE = 4


@dataclass
class Prepared:
    """One process's save after planning: what it holds, what it writes, where."""

    final: Location
    tmp: Location
    coord: Coordinator
    options: SaveOptions
    descs: Descriptors
    sources: list[Any]  # by leaf position: an ArraySource, or the value
    local: LocalPlan
    plan: GlobalPlan | None  # the coordinating process's global plan
    representative: bool  # this process sends its group's values at the commit
    plan_key: bytes  # names the global plan this process's local plan belongs to
    generation: str = ""  # names this save (its manifest records it)
    hold: Hold | None = None  # the coordinating process's hold on the destination
    stats: dict[str, Any] = field(default_factory=dict)
    bytes_written: int = 0
    written: list[str] = field(default_factory=list)  # objects this process began to write
    created: dict[str, bytes] = field(default_factory=dict)  # what its writes created in place (Store.created)
    manifest: Manifest | None = None  # the coordinating process's, once written

    def discard(self) -> None:
        """Remove what this process wrote for a failed save (the coordinating process: all of it)."""
        discard(self.tmp, self.written, hold=self.hold, plan=self.plan, generation=self.generation,
                created=self.created)

    @property
    def committed(self) -> bool:
        """Whether the coordinating process reached the commit point (:attr:`Hold.committed`)."""
        return self.hold is not None and self.hold.committed

    @property
    def what(self) -> str:
        """How messages name this save."""
        return f"save to {self.final}"


# -- step 1: describe and plan -------------------------------------------------------------------


def _source(key: Any, obj: Any) -> tuple[Any, LeafDesc]:
    if isinstance(obj, Value):
        values_format.check(obj.value)
        return obj.value, LeafDesc(key, "value", value_type=values_format.value_type(obj.value))
    if isinstance(obj, _SCALARS) and not isinstance(obj, np.generic):  # np.float64 subclasses float
        values_format.check(obj)  # a str that is not valid Unicode, an int beyond 4300 digits
        return obj, LeafDesc(key, "value", value_type=values_format.value_type(obj))
    make = registry.source_for(obj)
    if make is None:
        raise TreeError(f"cannot save a leaf of type {type(obj).__module__}.{type(obj).__qualname__}",
                        code="tree.unsupported_leaf", leaf=key_str(key))
    src: ArraySource = make(obj)
    dtypes.numpy_dtype(src.dtype)
    shape = tuple(int(s) for s in src.shape)
    if src.layout is not None:
        return src, LeafDesc(key, "array", shape, src.dtype, sharding=src.sharding, layout=src.layout)
    return src, LeafDesc(key, "array", shape, src.dtype, tuple(s.region for s in src.shards), sharding=src.sharding)


def describe(tree: Any, each: Callable[[int, Any, Any], None] | None = None) -> tuple[Descriptors, list[Any]]:
    """Flatten ``tree`` and describe each leaf; returns the descriptors and each leaf's source or value.
    ``each``, if given, is called with every leaf's position, key and source (or value) as soon as it is
    described."""
    notes: list[dict[str, Any]] = []

    def note(key: Any, obj: Any) -> None:
        said = registry.notes_for(obj)
        if said:
            notes.append({"key": list(key), **said})

    structure, leaves = flatten(tree, registry.save_view, note)
    descs, sources = [], []
    for key, obj in leaves:
        try:
            src, desc = _source(key, obj)
        except XckptError as exc:  # an adapter's or a value's refusal (a placement, a dtype) names no leaf
            raise exc.at(leaf=key_str(key)) from exc
        sources.append(src)
        descs.append(desc)
        if each is not None:
            each(len(sources) - 1, key, src)
    return Descriptors(structure, descs, notes), sources


class _Plans:
    """Plans of earlier saves, for a save of the same structure (each process keeps its own part)."""

    def __init__(self) -> None:
        # by (rank, digest of its description): the key of the global plan it was part of, its
        # answer and its local plan (the rank counts where several ranks share a process, as in tests)
        self.local: OrderedDict[tuple[int, bytes], tuple[bytes, dict[str, Any], LocalPlan]] = OrderedDict()
        self.root: OrderedDict[tuple[bytes, ...], GlobalPlan] = OrderedDict()
        self.lock = threading.Lock()

    @staticmethod
    def _put(cache: OrderedDict, key: Any, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > _PLAN_CACHE:
            cache.popitem(last=False)


_plans = _Plans()


def _digest(wire: bytes, coord: Coordinator, opts: SaveOptions) -> bytes:
    salt = f"{coord.world_size}/{opts.inner_chunk_bytes}/".encode()
    return digest(salt + wire)


def prepare(tree: Any, path: Any, *, coordinator: Coordinator | None = None, options: SaveOptions | None = None,
            speculate: Callable[[Prepared], None] | None = None,
            each_leaf: Callable[[int, Any, Any], None] | None = None) -> Prepared:
    """Collective step 1: describe the tree and agree on a plan. Every process calls it.

    ``speculate``, when this process has planned a save of the same description before, is
    called with that plan (``tmp`` not yet known) before the processes agree, so that work
    which only depends on it can start early; the returned plan is the same object
    (``local``) when the agreement confirms it. ``each_leaf`` is called with each leaf's
    position, key and source as soon as it is described (:func:`describe`'s ``each``).
    """
    registry.autoload()
    coord = coordinator or registry.default_coordinator() or collective.LocalCoordinator()
    opts = options or SaveOptions()
    final = Location.of(path)
    what = f"save to {final}"
    started = time.perf_counter()
    described: dict[str, Any] = {}

    def describe_local() -> dict[str, Any]:
        opts.check()
        try:
            descs, sources = describe(tree, each_leaf)
        except XckptError as exc:  # a leaf that cannot be saved: the error names the save's destination too
            raise exc.at(file=str(final)) from None
        if descs.notes:
            opts.metadata["xckpt.notes"] = descs.notes
        wire = descs.to_wire()
        d = _digest(wire, coord, opts)
        described.update(descs=descs, sources=sources, wire=wire, digest=d)
        with _plans.lock:
            cached = _plans.local.get((coord.rank, d))
        if cached is not None and speculate is not None:
            speculate(Prepared(final, final, coord, opts, descs, sources, cached[2], None, False, cached[0]))
        return {"digest": d, "plan": cached[0] if cached else None,
                "save": [final.url, opts.overwrite, opts.compression, opts.inner_chunk_bytes]}

    decided: dict[str, Any] = {}

    def decide(reports: list[dict[str, Any]]) -> dict[str, Any]:
        _check_same_save(reports)
        target = check_target(final, opts)
        digests = tuple(r["digest"] for r in reports)
        key = digest(b"".join(digests))  # names the global plan of exactly these descriptions
        with _plans.lock:
            plan = _plans.root.get(digests) if all(r["plan"] == key for r in reports) else None
        decided["plan"] = plan
        reps: dict[bytes, int] = {}
        for rank, d in enumerate(digests):
            reps.setdefault(d, rank)
        decided["digests"] = digests
        hold = decided["hold"] = Hold(target, new_generation(), opts.stale_after())
        return {"tmp": hold.tmp.url, "generation": hold.generation, "reuse": plan is not None,
                "reps": sorted(reps.values()), "plan": key}

    try:
        decision = collective.decide_step(coord, what, describe_local, decide)
        return _agree_plan(coord, opts, final, what, started, described, decided, decision)
    except BaseException:
        hold: Hold | None = decided.get("hold")
        if hold is not None:
            discard(hold.tmp, [], hold=hold)
        raise


def _check_same_save(reports: list[dict[str, Any]]) -> None:
    """Every process saves to one path with the same options: each writes its own chunks and ``zarr.json`` by
    them, so processes that differ would commit a checkpoint some of whose objects say otherwise."""
    ours = reports[0]["save"]
    for rank, r in enumerate(reports):
        if r["save"] != ours:
            said = lambda s: f"{s[0]} with overwrite={s[1]}, compression={s[2]!r}, inner_chunk_bytes={s[3]}"  # noqa: E731
            raise CoordinationError(f"the processes disagree on the save: rank {rank} saves to {said(r['save'])}, "
                                    f"rank 0 to {said(ours)}; every process must pass the same path and options")


def _agree_plan(coord: Coordinator, opts: SaveOptions, final: Location, what: str, started: float,
                described: dict[str, Any], decided: dict[str, Any], decision: dict[str, Any]) -> Prepared:
    """The rest of :func:`prepare`, once the coordinating process decided: the plan, reused or made."""
    d = described["digest"]
    representative = coord.rank in decision["reps"]
    plan: GlobalPlan | None = decided.get("plan")
    if decision["reuse"]:
        with _plans.lock:
            key, answer, local = _plans.local[coord.rank, d]
    else:
        sent = collective.gather_step(coord, what, lambda: described["wire"] if representative else None)

        def make_plan() -> list[dict[str, Any]]:
            assert sent is not None
            digests = decided["digests"]
            members: dict[bytes, list[int]] = {}
            for rank, dg in enumerate(digests):
                members.setdefault(dg, []).append(rank)
            order = list(members)
            groups = [(members[dg], Descriptors.from_wire(sent[members[dg][0]])) for dg in order]
            global_plan, answers = plan_save(groups, coord.world_size, inner_chunk_bytes=opts.inner_chunk_bytes)
            decided["plan"] = global_plan
            with _plans.lock:
                _plans._put(_plans.root, digests, global_plan)
            by_digest = dict(zip(order, answers))
            return [by_digest[dg] for dg in digests]

        answer = collective.answer_step(coord, what, make_plan if coord.rank == collective.ROOT else None)
        plan = decided.get("plan")
        local = collective.agree_step(coord, what, lambda: local_plan(described["descs"], answer, coord.rank))
        assert local is not None
        with _plans.lock:
            _plans._put(_plans.local, (coord.rank, d), (decision["plan"], answer, local))
        key = decision["plan"]
    p = Prepared(final, Location(decision["tmp"]), coord, opts, described["descs"], described["sources"], local,
                 plan, representative, key, decision["generation"], decided.get("hold"))
    p.stats["plan_s"] = time.perf_counter() - started
    p.stats["plan_reused"] = bool(decision["reuse"])
    return p


# -- step 2: write -------------------------------------------------------------------------------


def held_shards(p: Prepared) -> dict[tuple[int, Any], Shard]:
    """The shard this process holds for each box it writes, its device-to-host copy started."""
    out: dict[tuple[int, Any], Shard] = {}
    for t in p.local.tasks:
        if (t.leaf, t.piece) in out:
            continue
        src = p.sources[t.leaf]
        shard = next((s for s in src.shards if s.region == t.piece), None)
        if shard is None:
            raise SaveError(f"the plan has this process write {t.piece.offsets}+{t.piece.sizes}, which it does "
                            "not hold", leaf=key_str(p.descs.leaves[t.leaf].key))
        out[(t.leaf, t.piece)] = shard
    for shard in out.values():
        if shard.prefetch is not None:
            shard.prefetch()
    return out


def storage_view(data: Any, shape: tuple[int, ...], dtype: str, leaf: str) -> np.ndarray:
    """Fetched shard data checked against its box and logical dtype, as its storage dtype (a sub-byte type's
    bytes with their high bits clear: :func:`xckpt.format.dtypes.canonical`)."""
    arr = np.asarray(data)
    if tuple(arr.shape) != shape or dtypes.logical_name(arr.dtype) != dtype:
        raise SaveError(f"shard data has shape {arr.shape} and dtype {arr.dtype}, expected {shape} {dtype}",
                        leaf=leaf)
    return dtypes.canonical(arr.view(np.uint8), dtype) if dtypes.is_raw(dtype) else arr


ChunkJob = tuple[str, shard.Geometry, np.ndarray, str]  # (object name, geometry, data, leaf)


def plan_chunks(local: LocalPlan, descs: Descriptors, fetch: Callable[[int, Region], Any],
                compression: str) -> Iterator[ChunkJob]:
    """Every chunk a process writes (one per task of its plan, in the plan's order), its data cut from
    what ``fetch(leaf position, box)`` gives.

    A generator: each box is fetched when its first chunk is reached and dropped after its last
    (the plan lists a box's chunks together), so a writer that waits for room bounds the memory.
    """
    current: tuple[int, Region] | None = None
    data: np.ndarray | None = None
    for t in local.tasks:
        d = descs.leaves[t.leaf]
        leaf = key_str(d.key)
        if current != (t.leaf, t.piece):
            current, data = (t.leaf, t.piece), None
            data = storage_view(_fetched(fetch, t.leaf, t.piece, leaf), t.piece.sizes, d.dtype, leaf)
        assert data is not None
        layout = local.leaves[t.leaf]
        seg, inner = layout.segments[t.segment]
        geom = zarr.geometry(dtypes.storage_name(d.dtype), seg.chunk, inner, compression)
        yield layout.object_name(t.segment, t.index), geom, data[t.box.relative_to(t.piece).slices()], leaf


def _fetched(fetch: Callable[[int, Region], Any], pos: int, piece: Region, leaf: str) -> Any:
    """``fetch(pos, piece)``; what it raises names the leaf (a source's own error, or ``save.failed``)."""
    try:
        return fetch(pos, piece)
    except XckptError as exc:
        raise exc.at(leaf=leaf) from exc
    except Exception as exc:  # noqa: BLE001 - a framework's or a user's error while reading the data
        raise SaveError(f"reading the data of this leaf failed: {type(exc).__name__}: {exc}", leaf=leaf) from exc


def chunk_jobs(p: Prepared) -> Iterator[ChunkJob]:
    """Every chunk this process writes, its data fetched to the host as the caller goes."""
    shards = held_shards(p)
    return plan_chunks(p.local, p.descs, lambda pos, piece: shards[(pos, piece)].fetch(), p.options.compression)


def metadata_files(p: Prepared) -> list[tuple[str, bytes]]:
    """The ``zarr.json`` files this process writes (of the arrays whose first chunk it writes)."""
    return zarr_files(p.local, p.descs, p.options.compression)


def zarr_files(local: LocalPlan, descs: Descriptors, compression: str) -> list[tuple[str, bytes]]:
    """The ``zarr.json`` files a process writes: of the arrays whose first chunk it writes."""
    return [array_metadata(local.leaves[pos], descs.leaves[pos].dtype, seg, compression)
            for pos, seg in local.metadata]


def write(p: Prepared) -> int:
    """Step 2: write every chunk object and ``zarr.json`` assigned to this process; returns the array bytes."""
    started = time.perf_counter()
    failpoints.hit("after_plan", p.coord.rank)
    store = p.tmp.store(create=True)
    w = ChunkWriter(store, p.generation, p.options.max_inflight_bytes)
    try:
        with w:
            for name, data in metadata_files(p):
                w.file(name, data)
            for i, (name, geom, data, leaf) in enumerate(chunk_jobs(p)):
                w.chunk(name, geom, data, leaf)
                if i == 0:
                    failpoints.hit("mid_write", p.coord.rank)
        w.sync()
    finally:
        p.written.extend(w.names)
        try:
            store.close()  # the writes in flight land: what they created is known
        finally:
            p.created.update(store.created)
    failpoints.hit("after_write", p.coord.rank)
    p.bytes_written = w.bytes_written
    p.stats["write_s"] = time.perf_counter() - started
    return w.bytes_written


# -- step 3: commit ------------------------------------------------------------------------------


def local_values(p: Prepared) -> dict[int, Any]:
    """This process's value leaves, by position in its descriptors."""
    return {i: p.sources[i] for i, d in enumerate(p.descs.leaves) if d.kind == "value"}


def report(p: Prepared, values: dict[int, Any]) -> dict[str, Any]:
    """What this process reports at the commit: its bytes written, and its values (a representative of
    its group) or their digest."""
    blob = values_format.encode(values)
    return {"bytes": p.bytes_written, "plan": p.plan_key, "values": blob if p.representative else None,
            "values_digest": hashlib.blake2b(blob, digest_size=16).digest(),
            "value_digests": [hashlib.blake2b(values_format.encode(values[pos]), digest_size=8).digest()
                              for pos in sorted(values)]}  # to name the leaf two processes disagree on


def merge_values(plan: GlobalPlan, statuses: list[dict[str, Any]]) -> dict[int, Any]:
    """Every value leaf by global index, from each group's representative; processes must agree."""
    out: dict[int, Any] = {}
    source: dict[int, int] = {}
    for g, ranks in enumerate(plan.groups):
        rep = statuses[ranks[0]]
        digest_ = rep["values_digest"]
        differ = [r for r in ranks if statuses[r]["values_digest"] != digest_]
        decoded = values_format.decode(rep["values"])
        if differ:
            pairs = zip(sorted(decoded), rep["value_digests"], statuses[differ[0]]["value_digests"])
            pos = next((pos for pos, a, b in pairs if a != b), None)
            raise CoordinationError(f"ranks {ranks[0]} and {differ[0]} save different values under the same keys; "
                                    "values must be equal on every process that holds them",
                                    leaf=None if pos is None else key_str(plan.keys[plan.positions[g][pos]]))
        for pos, value in decoded.items():
            i = plan.positions[g][pos]
            if i in out:
                if values_format.encode(out[i]) != values_format.encode(value):
                    raise CoordinationError(f"ranks {source[i]} and {ranks[0]} save different values",
                                            leaf=key_str(plan.keys[i]))
                continue
            out[i], source[i] = value, ranks[0]
    return out


def check_complete(plan: GlobalPlan, key: bytes, statuses: list[dict[str, Any]]) -> None:
    """Refuse to commit unless every process wrote its part of this very plan, and the array bytes
    written add up to the arrays' size."""
    stale = [r for r, s in enumerate(statuses) if s["plan"] != key]
    if stale:
        raise CoordinationError(f"ranks {stale[:8]} wrote their part of another plan; nothing is committed")
    want = sum(math.prod(a.shape) * dtypes.itemsize(a.dtype) for a in plan.arrays.values())
    got = sum(s["bytes"] for s in statuses)
    if got != want:
        raise CoordinationError(f"the processes wrote {got} bytes of array data, the arrays hold {want}; "
                                "nothing is committed")


def finish(p: Prepared, statuses: list[dict[str, Any]]) -> Manifest:
    """The coordinating process's commit, from every process's :func:`report`: values, Orbax view,
    manifest, marker, then the move into place."""
    assert p.plan is not None and p.hold is not None
    p.stats["bytes_per_rank"] = [s["bytes"] for s in statuses]
    check_complete(p.plan, p.plan_key, statuses)
    values = merge_values(p.plan, statuses)
    failpoints.hit("before_commit_files")
    store = p.tmp.store(create=True)
    try:
        manifest = p.manifest = write_commit_files(store, p.plan, values, p.options, p.generation, hold=p.hold,
                                                   written=p.written)
        write_marker(store, p.hold)
    finally:
        try:
            store.close()  # the writes in flight land: what they created is known
        finally:
            p.created.update(store.created)
    publish(p.tmp, p.hold.target, p.generation, hold=p.hold)
    p.hold.end()
    return manifest


def commit(p: Prepared, local_error: BaseException | None = None) -> Manifest | None:
    """Collective step 3: agree that every write succeeded, then commit.

    Returns the manifest on the coordinating process, None on the others. On failure nothing
    is committed, the temporary data is removed, and every process raises the same error. A
    process that loses the coordinating process during this step cannot know the outcome: it
    keeps what it wrote (a committed checkpoint may hold it) and raises ``save.outcome_unknown``.
    The coordinating process that committed but cannot tell the others (they timed out, or died)
    returns the manifest all the same, with an :class:`~xckpt.errors.XckptWarning`.
    """
    started = time.perf_counter()
    values = local_values(p)
    result: dict[str, Any] = {}

    def root(statuses: list[dict[str, Any]]) -> None:
        try:
            result["manifest"] = finish(p, statuses)
        except BaseException as exc:  # noqa: BLE001 - raised below, once the others know the save committed
            if not p.committed:
                raise
            # after the commit only an interrupt, or a warning the warnings filter turned into an error, gets
            # here (a failure there is a warning): the others are told the save committed, this process raises
            # it as it is
            result["manifest"], result["after"] = p.manifest, exc
            if p.hold is not None:
                p.hold.end()

    try:
        try:
            collective.decide_step(p.coord, p.what, lambda: _report_or_raise(p, values, local_error), root)
        except BaseException as exc:
            if p.coord.rank != collective.ROOT and not isinstance(exc, CollectiveError) and local_error is None:
                # the exchange itself broke (the coordinating process died or timed out): whether it
                # committed is unknown, so this process's objects stay (they age into leftovers)
                raise SaveError(f"the coordinating process did not report the outcome of the commit ({exc}); the "
                                f"checkpoint at {p.final} may or may not be committed: load it to find out",
                                code="save.outcome_unknown", file=str(p.final)) from exc
            if p.committed and "manifest" in result and not isinstance(exc, CollectiveError):
                # committed, and only telling the others failed: they raise save.outcome_unknown
                warnings.warn(XckptWarning(f"the checkpoint at {p.final} is committed, but the other processes "
                                           f"could not be told ({exc})"), stacklevel=3)
                p.stats["commit_s"] = time.perf_counter() - started
                if "after" in result:
                    raise result["after"]
                return result["manifest"]
            if not p.committed:
                p.discard()
            elif p.hold is not None:
                p.hold.end()
            raise
    except XckptError as exc:
        raise commit_failed(p.final, exc) from exc
    p.stats["commit_s"] = time.perf_counter() - started
    if "after" in result:
        raise result["after"]
    return result.get("manifest")


def _report_or_raise(p: Prepared, values: dict[int, Any], error: BaseException | None) -> dict[str, Any]:
    if error is not None:
        raise error
    return report(p, values)


def save(tree: Any, path: Any, *, coordinator: Coordinator | None = None,
         options: SaveOptions | None = None) -> Manifest | None:
    """Prepare, write and commit (see the module docstring)."""
    p = prepare(tree, path, coordinator=coordinator, options=options)
    error: BaseException | None = None
    try:
        write(p)
    except Exception as exc:  # noqa: BLE001 - every process must reach the commit
        error = exc
    except BaseException:  # an interrupt (KeyboardInterrupt): no collective step now; remove what was written
        p.discard()
        raise
    return commit(p, error)
