"""Region maths (xckpt/format/regions.py), checked against brute-force oracles on random inputs."""

from __future__ import annotations

import math
import os
import struct

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from xckpt.errors import ShapeError, XckptError
from xckpt.format import shard
from xckpt.format.regions import (Region, check_tiling, chunk_indices, chunks_of, grid_shape, inner_chunk_shape_for,
                                  intersect, walk)

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def shapes(draw: st.DrawFn, min_rank: int = 0, max_rank: int = 3, min_dim: int = 1, max_dim: int = 10) -> tuple:
    rank = draw(st.integers(min_rank, max_rank))
    return tuple(draw(st.lists(st.integers(min_dim, max_dim), min_size=rank, max_size=rank)))


@st.composite
def tilings(draw: st.DrawFn, max_regions: int = 12) -> tuple[tuple[int, ...], list[Region]]:
    """A shape and a random guillotine tiling of it (boxes split recursively; not a regular grid)."""
    shape = draw(shapes())
    boxes = [Region.full(shape)]
    for _ in range(draw(st.integers(0, max_regions - 1))):
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        dims = [d for d in range(len(shape)) if b.sizes[d] > 1]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, b.sizes[d] - 1))
        first = Region(b.offsets, b.sizes[:d] + (cut,) + b.sizes[d + 1:])
        second = Region(b.offsets[:d] + (b.offsets[d] + cut,) + b.offsets[d + 1:],
                        b.sizes[:d] + (b.sizes[d] - cut,) + b.sizes[d + 1:])
        boxes[i:i + 1] = [first, second]
    return shape, boxes


@st.composite
def boxes_in(draw: st.DrawFn, shape: tuple[int, ...], slack: int = 2) -> Region:
    """A random box near ``shape`` (it may stick out of it, or be empty)."""
    offs, sizes = [], []
    for n in shape:
        o = draw(st.integers(0, n + slack - 1))
        offs.append(o)
        sizes.append(draw(st.integers(0, n + slack - o)))
    return Region(tuple(offs), tuple(sizes))


def coverage(shape: tuple[int, ...], regions: list[Region]) -> np.ndarray:
    """How many regions cover each element (the brute-force oracle)."""
    count = np.zeros(shape, dtype=np.int64)
    for r in regions:
        count[r.slices()] += 1
    return count


def chunk_box(idx: tuple[int, ...], chunk: tuple[int, ...], shape: tuple[int, ...]) -> Region:
    offs = tuple(i * c for i, c in zip(idx, chunk))
    return Region(offs, tuple(min(c, n - o) for o, c, n in zip(offs, chunk, shape)))


@settings(max_examples=300, deadline=None)
@given(shapes(max_rank=2, max_dim=6), st.data())
def test_check_tiling_agrees_with_counting(shape: tuple, data: st.DataObject) -> None:
    slack = data.draw(st.integers(0, 1))
    regions = data.draw(st.lists(boxes_in(shape, slack=slack), max_size=6))
    inside = all(r.is_empty() or r.within(shape) for r in regions)
    exact = inside and bool(np.all(coverage(shape, [r for r in regions if r.within(shape)]) == 1))
    why = check_tiling(shape, regions)
    assert (why is None) == exact, (regions, why)


def test_check_tiling_examples() -> None:
    assert check_tiling((4,), [Region((0,), (2,)), Region((2,), (2,))]) is None
    assert "overlap" in check_tiling((2,), [Region((0,), (1,)), Region((0,), (1,))])  # counts alone agree
    assert "exceeds" in check_tiling((2,), [Region((0,), (3,))])
    assert check_tiling((0, 3), [Region((0, 0), (0, 3))]) is None and check_tiling((0,), []) is None
    assert check_tiling((), [Region((), ())]) is None and check_tiling((), []) is not None


@SETTINGS
@given(tilings(), st.data())
def test_check_tiling_detects_each_kind_of_defect(tiling: tuple, data: st.DataObject) -> None:
    shape, regions = tiling
    assert check_tiling(shape, regions) is None
    assert check_tiling(shape, list(reversed(regions))) is None  # order does not matter
    if math.prod(shape) == 0 or not shape:
        return
    i = data.draw(st.integers(0, len(regions) - 1))
    assert "cover" in check_tiling(shape, regions[:i] + regions[i + 1:])  # a gap
    assert "overlap" in check_tiling(shape, regions + [regions[i]])  # a duplicate (replicas are deduplicated first)
    r = regions[i]
    d = data.draw(st.integers(0, len(shape) - 1))
    grown = Region(r.offsets, r.sizes[:d] + (r.sizes[d] + 1,) + r.sizes[d + 1:])
    why = check_tiling(shape, regions[:i] + [grown] + regions[i + 1:])
    assert why is not None and ("overlap" in why or "exceeds" in why)


@SETTINGS
@given(shapes(min_rank=1), st.integers(1, 8), st.integers(1, 4096))
def test_inner_chunks_divide_chunks_and_respect_the_byte_target(chunk: tuple, itemsize: int, target: int) -> None:
    inner = inner_chunk_shape_for(chunk, itemsize, target)
    assert len(inner) == len(chunk)
    assert all(i >= 1 and c % i == 0 for c, i in zip(chunk, inner))
    if math.prod(chunk) * itemsize <= target:
        assert inner == tuple(chunk)  # nothing split without need
    elif itemsize <= target:
        assert math.prod(inner) * itemsize <= target
    else:
        assert inner == tuple(1 for _ in chunk)  # one element per inner chunk is the best possible
    assert inner_chunk_shape_for(chunk, itemsize, target) == inner


def test_inner_chunk_examples() -> None:
    assert inner_chunk_shape_for((2, 4), 4, 16) == (2, 2)  # the largest dimension is halved first
    assert inner_chunk_shape_for((832, 3328), 4, 4 << 20) == (832, 832)  # reshardable along either dimension
    assert inner_chunk_shape_for((6271, 768), 4, 4 << 20) == (6271, 96)  # a prime dimension is not cut to 1
    assert inner_chunk_shape_for((1024, 1024), 4, 4 << 20) == (1024, 1024)
    assert inner_chunk_shape_for((7,), 8, 8) == (1,)
    assert inner_chunk_shape_for((), 4, 1) == ()


@SETTINGS
@given(shapes(max_rank=3, max_dim=8), st.data())
def test_intersect_agrees_with_masks(shape: tuple, data: st.DataObject) -> None:
    a, b = data.draw(boxes_in(shape, slack=0)), data.draw(boxes_in(shape, slack=0))
    both = (coverage(shape, [a]) + coverage(shape, [b])) == 2
    got = intersect(a, b)
    assert got == intersect(b, a)
    if not both.any():
        assert got is None
    else:
        assert got is not None and np.array_equal(coverage(shape, [got]) == 1, both)


@SETTINGS
@given(shapes(min_rank=1, max_dim=9), st.data())
def test_chunks_of_is_exactly_the_chunks_a_region_touches(shape: tuple, data: st.DataObject) -> None:
    chunk = tuple(data.draw(st.integers(1, n)) for n in shape)
    region = data.draw(boxes_in(shape, slack=0))
    want = {idx for idx in chunk_indices(shape, chunk)
            if intersect(chunk_box(idx, chunk, shape), region) is not None}
    got = list(chunks_of(region, chunk))
    assert len(got) == len(set(got)) and set(got) == want
    assert len(list(chunk_indices(shape, chunk))) == math.prod(grid_shape(shape, chunk))


def test_region_basics() -> None:
    r = Region((1, 2), (3, 4))
    assert r.ends == (4, 6) and r.numel == 12 and not r.is_empty()
    assert r.slices() == (slice(1, 4), slice(2, 6))
    assert r.relative_to(Region((1, 0), (5, 9))) == Region((0, 2), (3, 4))
    assert r.within((4, 6)) and not r.within((4, 5)) and not r.within((4, 6, 1))
    assert Region.from_json(r.to_json()) == r
    assert Region.full((2, 3)) == Region((0, 0), (2, 3))
    assert Region((0,), (0,)).is_empty() and Region((), ()).numel == 1
    assert grid_shape((10, 3), (4, 3)) == (3, 1)
    for bad in (((0,), (1, 1)), ((-1,), (1,)), ((0,), (-2,))):
        with pytest.raises(ShapeError):
            Region(*bad)


@st.composite
def _geometries(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    rank = draw(st.integers(0, 3))
    inner = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    chunk = tuple(i * draw(st.integers(1, 5)) for i in inner)
    valid = tuple(draw(st.integers(1, c)) for c in chunk)
    return chunk, inner, valid


@given(_geometries())
@settings(max_examples=300, deadline=None)
def test_inner_chunks_visit_exactly_those_intersecting_the_array(geom: tuple) -> None:
    """Only the inner chunks inside the valid part are visited (numbered in C order of the whole inner
    grid), so a chunk object declaring a huge inner grid costs only what the array covers."""
    from itertools import product

    from xckpt.format.shard import Geometry
    chunk, inner, valid = geom
    g = Geometry(chunk, inner, np.dtype("float32"))
    every = list(product(*(range(c // i) for c, i in zip(chunk, inner))))
    want = [(k, tuple(a * b for a, b in zip(pos, inner))) for k, pos in enumerate(every)
            if all(a * b < v for a, b, v in zip(pos, inner, valid))]
    got = list(g.inner_chunks(valid))
    assert [(k, start) for k, start, _ in got] == want
    for _, start, sl in got:
        assert all(s.start == a and s.stop == min(a + i, v) for s, a, i, v in zip(sl, start, inner, valid))
    assert np.flatnonzero(g.needed(valid)).tolist() == [k for k, _ in want]


@given(_geometries(), st.sampled_from(["<f4", ">f4", "<f8", "|u1", "<i2"]), st.sampled_from([1, 8, 24, 1 << 18]),
       st.sampled_from(["c", "f", "step"]), st.booleans())
@settings(max_examples=300, deadline=None)
def test_encoded_object_equals_brute_force_layout(geom: tuple, dtype: str, piece: int, order: str,
                                                  tagged: bool) -> None:
    """An encoded chunk object is exactly its inner chunks (zero-padded, C order, little-endian, each
    followed by its crc32c), then the place tag and the checksummed index, whatever the data's memory
    layout and however the encoder pieces it (small pieces exercise every block boundary), streamed in
    pieces or built whole, from the data as it lies or first laid out as stored (an asynchronous save's copy),
    and as a save's writer writes it into a file (each inner chunk copied or laid out, checksummed and
    written in one compiled call where it can)."""
    import tempfile

    import crc32c

    from xckpt.engine import hostcopy
    from xckpt.engine.storage import LocalStore
    from xckpt.format import shard
    chunk, inner, valid = geom
    data = (np.arange(math.prod(valid) or 1, dtype="f8")[:math.prod(valid)] * 1.5 + 1).reshape(valid).astype(dtype)
    if order == "f" and valid:
        data = np.asfortranarray(data)
    elif order == "step" and valid:
        wide = np.zeros(valid[:-1] + (valid[-1] * 2,), dtype=dtype)
        wide[..., ::2] = data
        data = wide[..., ::2]
    old = shard.PIECE_BYTES
    shard.PIECE_BYTES = piece
    try:
        g = shard.Geometry(chunk, inner, np.dtype(dtype).newbyteorder("="))
        place = b"gen\0a/c/0" if tagged else None
        got = shard.encode(g, data, place)
        scratch = np.empty(g.scratch_nbytes, dtype=np.uint8)
        streamed = b"".join(bytes(part) for part in shard.buffers(shard.encode_parts(g, data, scratch, place)))
        with tempfile.TemporaryDirectory() as d:
            store = LocalStore(d, create=True)
            store.write("c/0", shard.encode_parts(g, data, scratch, place, hostcopy.copy_checksum))
            store.close()
            with open(os.path.join(d, "c", "0"), "rb") as f:
                written = f.read()
        buf = np.full(shard.laid_nbytes(g, valid), 0xAB, dtype=np.uint8)  # not zeroed: padding must be written
        laid = shard.lay_out(g, data, buf)
        from_laid = b"".join(bytes(part) for part in shard.buffers(shard.encode_parts(g, laid, np.empty(0, np.uint8),
                                                                                     place)))
        with tempfile.TemporaryDirectory() as d:
            store = LocalStore(d, create=True)
            store.write("c/0", shard.encode_parts(g, laid, np.empty(0, np.uint8), place))
            store.close()
            with open(os.path.join(d, "c", "0"), "rb") as f:
                written_laid = f.read()
        laid_whole = shard.encode(g, laid, place)
    finally:
        shard.PIECE_BYTES = old
    body, index = b"", np.full((g.n_inner, 2), shard.MISSING, dtype="<u8")
    for k, _, sl in g.inner_chunks(valid):
        padded = np.zeros(inner, dtype=np.dtype(dtype).newbyteorder("<"))
        padded[tuple(slice(0, s.stop - s.start) for s in sl) + (Ellipsis,)] = data[sl + (Ellipsis,)]
        payload = padded.tobytes()
        index[k] = (len(body), len(payload) + 4)
        body += payload + crc32c.crc32c(payload).to_bytes(4, "little")
    raw_index = index.tobytes()
    index_part = raw_index + crc32c.crc32c(raw_index).to_bytes(4, "little")
    tag = shard.place_tag(place, index_part) if tagged else b""
    assert got == body + tag + index_part
    assert streamed == got  # a writer's pieces, and a whole object built at once (a small leaf's), agree
    assert written == got and written_laid == got
    assert from_laid == got and laid_whole == got
    assert laid.nbytes == len(body) - 4 * sum(1 for _ in g.inner_chunks(valid))  # the payloads, nothing more


def test_inner_chunk_shapes_never_exceed_the_format_limit() -> None:
    from xckpt.format.regions import MAX_INNER
    inner = inner_chunk_shape_for((2**22, 64), 4, 16)  # a tiny target would ask for 2**24 inner chunks
    assert math.prod(c // i for c, i in zip((2**22, 64), inner)) <= MAX_INNER


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=3), data=st.data())
def test_strides_overlap_is_true_for_every_array_whose_elements_overlap(shape, data):
    """regions.strides_overlap against brute force over as_strided views of one buffer: never False where
    two elements share a byte, and False for any slice or transpose of a plain array."""
    from numpy.lib.stride_tricks import as_strided
    from xckpt.format.regions import strides_overlap

    def overlaps_itself(a: np.ndarray) -> bool:
        return strides_overlap(a.shape, a.strides, a.itemsize)

    itemsize = data.draw(st.sampled_from([1, 2, 4]))
    strides = [data.draw(st.integers(0, 24)) for _ in shape]  # in bytes: any, aligned or not
    span = sum(s * (n - 1) for s, n in zip(strides, shape) if n) + itemsize
    buf = np.zeros(span // itemsize + 2, np.dtype(f"u{itemsize}"))
    arr = as_strided(buf, shape=tuple(shape), strides=tuple(strides), writeable=False)
    assert arr.itemsize == itemsize
    starts = [sum(i * s for i, s in zip(idx, strides)) for idx in np.ndindex(*shape)]
    taken: set[int] = set()
    overlap = False
    for s0 in starts:
        cells = set(range(s0, s0 + itemsize))
        overlap = overlap or bool(cells & taken)
        taken |= cells
    if overlap:
        assert overlaps_itself(arr)
    plain = np.zeros(tuple(shape), np.dtype(f"u{itemsize}"))
    assert not overlaps_itself(plain) and not overlaps_itself(plain.T) and not overlaps_itself(plain[..., ::-1])
    if plain.ndim >= 1 and plain.shape[0] > 2:
        assert not overlaps_itself(plain[::2])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=4))
def test_count_chunks_counts_what_chunks_of_yields(dims: list[tuple[int, int, int]]) -> None:
    from xckpt.format.regions import count_chunks

    region = Region(tuple(o for o, _, _ in dims), tuple(n for _, n, _ in dims))
    chunk = tuple(c for _, _, c in dims)
    assert count_chunks(region, chunk) == len(list(chunks_of(region, chunk)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 9)), max_size=4))
def test_chunk_boxes_tile_the_array(dims: list[tuple[int, int]]) -> None:
    """The boxes of every chunk index cover the array exactly once, each within it and at most a chunk big."""
    from xckpt.format.regions import chunk_box

    shape, chunk = tuple(n for n, _ in dims), tuple(c for _, c in dims)
    boxes = [chunk_box(i, chunk, shape) for i in chunk_indices(shape, chunk)]
    assert check_tiling(shape, boxes) is None
    assert all(b.within(shape) and all(0 < x <= c for x, c in zip(b.sizes, chunk)) for b in boxes)
    assert [b.offsets for b in boxes] == [tuple(i * c for i, c in zip(ix, chunk)) for ix in chunk_indices(shape, chunk)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 20), st.integers(0, 20)),
                max_size=4))
def test_placed_in_undoes_relative_to(dims: list[tuple[int, int, int, int]]) -> None:
    """A region inside ``outer``, made relative to it and placed back in it, is itself; placed in it, a region
    given in ``outer``'s coordinates moves by ``outer``'s offsets and keeps its sizes."""
    outer = Region(tuple(o for o, _, _, _ in dims), tuple(a + n + b for _, a, n, b in dims))
    inner = Region(tuple(o + a for o, a, _, _ in dims), tuple(n for _, _, n, _ in dims))
    assert inner.relative_to(outer).placed_in(outer) == inner
    local = Region(tuple(a for _, a, _, _ in dims), inner.sizes)
    assert local.placed_in(outer) == inner


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), max_size=4))
def test_walk_visits_the_grid_in_c_order(spans: list[tuple[int, int]]) -> None:
    """walk is itertools.product over ranges of step 1: every index, once, in C order."""
    import itertools
    ranges = [range(start, start + n) for start, n in spans]
    assert list(walk(ranges)) == list(itertools.product(*ranges))


def test_walking_a_grid_makes_no_index_before_it_is_asked_for() -> None:
    """A grid may declare 2**24 chunks along one dimension (a hostile one, far more): the walk gives the
    first index at once (itertools.product first copied each range into a tuple, about 600 MB for 2**24; the
    validator walked a fuzzed manifest's grid that way and ran out of memory)."""
    assert next(chunk_indices((2**40, 3), (1, 1))) == (0, 0)
    assert next(chunk_indices((4, 2**40), (1, 2))) == (0, 0)
    first = chunks_of(Region((5, 0), (2**40, 2)), (1, 1))
    assert [next(first) for _ in range(3)] == [(5, 0), (5, 1), (6, 0)]
    assert list(chunk_indices((0, 2**40), (1, 1))) == [] and list(chunk_indices((), ())) == [()]


def _index_verdict(g: shard.Geometry, entries: list[tuple[int, int]], valid: tuple[int, ...], data_end: int,
                   known: bool) -> str | None:
    """What the spec says of an index (the error code, or None), worked out another way than the reader: a
    map of how often each data byte is covered, one byte at a time."""
    needed = {k for k, _, _ in g.inner_chunks(valid)}
    present = [(k, o, n) for k, (o, n) in enumerate(entries) if (o, n) != (shard.MISSING, shard.MISSING)]
    if needed - {k for k, _, _ in present}:
        return "chunk.missing"
    if any(n < 4 or o + n > data_end for _, o, n in present):
        return "chunk.truncated"
    exact = g.inner_nbytes + 4
    if g.compression == "none" and any(n != exact for _, _, n in present):
        return "chunk.truncated" if any(n < exact for _, _, n in present) else "chunk.size"
    last = max((o + n for _, o, n in present), default=0)  # at most data_end, checked above
    cover = [0] * last
    for _, o, n in present:
        for b in range(o, o + n):
            cover[b] += 1
    if any(c > 1 for c in cover):
        return "chunk.overlap"
    if any(c == 0 for c in cover) or (known and last != data_end):
        return "chunk.gap"
    return None


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_parse_index_refuses_exactly_what_a_byte_map_refuses(data: st.DataObject) -> None:
    """The reader's index checks against :func:`_index_verdict` on indexes made well, then disturbed: entries
    moved, resized, swapped, dropped; objects of several sizes, with and without a known size."""
    n_inner = data.draw(st.integers(1, 6))
    compressed = data.draw(st.booleans())
    g = shard.Geometry((2 * n_inner,), (2,), np.dtype("u1"), "zstd" if compressed else "none")
    valid = (data.draw(st.integers(1, 2 * n_inner)),)
    order = data.draw(st.permutations(range(n_inner)))
    entries, at = [(shard.MISSING, shard.MISSING)] * n_inner, 0
    for k in order:
        if k * 2 >= valid[0] and data.draw(st.booleans()):
            continue  # wholly outside the array: may be left out
        n = 6 if not compressed else data.draw(st.integers(4, 9))
        entries[k], at = (at, n), at + n
    for _ in range(data.draw(st.integers(0, 2))):
        k = data.draw(st.integers(0, n_inner - 1))
        o, n = entries[k]
        how = data.draw(st.sampled_from(["offset", "size", "drop", "swap"]))
        if how == "drop":
            entries[k] = (shard.MISSING, shard.MISSING)
        elif how == "swap":
            j = data.draw(st.integers(0, n_inner - 1))
            entries[k], entries[j] = entries[j], entries[k]
        elif (o, n) != (shard.MISSING, shard.MISSING):
            d = data.draw(st.integers(-7, 7))
            entries[k] = (max(0, o + d), n) if how == "offset" else (o, max(0, n + d))
    data_end = at + data.draw(st.sampled_from([0, 0, -1, 1, 5]))
    known = data.draw(st.booleans())
    body = b"".join(struct.pack("<QQ", o, n) for o, n in entries)
    tail = body + crc32c.crc32c(body).to_bytes(4, "little")
    size = max(data_end, 0) + len(tail)
    # an object of unknown size may be as large as any valid one (any size at all, compressed)
    limit = max(data_end, 0) if known else 2**63 - 1 - len(tail) if compressed else n_inner * 6
    want = _index_verdict(g, entries, valid, limit, known)
    least = -(-valid[0] // 2) * 6 + len(tail)
    if known and not compressed and size < least:
        want = "chunk.truncated"  # told by the object's size before the index is read
    try:
        index = shard.parse_index(g, tail, size if known else None, valid)
    except XckptError as exc:
        assert exc.code == want, (entries, valid, data_end, known)
    else:
        assert want is None, (entries, valid, data_end, known)
        assert index.tolist() == [list(e) for e in entries]


@settings(max_examples=200, deadline=None)
@given(home=st.lists(st.from_regex(r"[a-z][a-z0-9._]{0,6}", fullmatch=True), min_size=1, max_size=3),
       index=st.lists(st.integers(0, 10**6), max_size=4))
def test_chunk_object_names_are_told_from_every_other_file(home, index):
    """``is_chunk_object`` holds for every chunk key of every array home (a chunk object's bytes name its save, so a
    save judged dead may delete one it created) and for nothing else a save writes: ``zarr.json``, the reserved files
    at the top, the Orbax marker."""
    from xckpt.format import names, zarr

    path = "/".join(home)
    assert zarr.is_chunk_object(f"{path}/{zarr.chunk_key(index)}")
    assert not zarr.is_chunk_object(f"{path}/{zarr.METADATA}")
    assert not zarr.is_chunk_object(f"{path}/{'/'.join(str(i) for i in index)}") or home[-1] == "c"
    for name in (*names.RESERVED, names.ORBAX_MARKER, f"{path}/c/x"):
        assert not zarr.is_chunk_object(name)
