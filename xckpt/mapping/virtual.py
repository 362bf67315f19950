"""Views computed chunk by chunk in Python (``ts.virtual_chunked``), and the event loop they run on.

Their chunk callbacks are coroutines awaiting reads of the stored arrays, run on
an event loop of their own (a daemon thread), so a callback never blocks a
TensorStore thread that the stored read needs. The loop is stopped, and its thread
joined, when the interpreter exits: a callback that failed is still being wound up
on that thread after its error reached the caller, and an exit that tears TensorStore
down meanwhile aborted the process about one time in two.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Any, Sequence

import numpy as np
import tensorstore as ts

from xckpt.engine.views import view_chunk_shape
from xckpt.errors import KeyMismatchError
from xckpt.format import dtypes
from xckpt.format.casts import unfit

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()
#: How long the exit waits for the loop's thread to finish what it is doing.
STOP_WAIT_S = 5.0


def event_loop() -> asyncio.AbstractEventLoop:
    """The event loop that runs chunk callbacks (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="xckpt-mapping-views", daemon=True)
            thread.start()
            atexit.register(_stop, loop, thread)
            _loop = loop
    return _loop


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Stop the loop and wait for its thread (at exit, before TensorStore is torn down)."""
    loop.call_soon_threadsafe(loop.stop)
    thread.join(STOP_WAIT_S)


def context() -> ts.Context:
    """A fresh context without cache for a virtual view (its chunks are computed once)."""
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}})


def same_view(stores: Sequence[ts.TensorStore], names: Sequence[str]) -> ts.TensorStore:
    """A view of ``stores[0]`` that, when read, checks every store holds the same values.

    Used where several stored leaves become one target (torch keeps Adam's ``step`` per
    parameter, optax one ``count``); differing values fail the read, naming the leaves.
    """
    first = stores[0]

    async def read(domain: ts.IndexDomain, array: np.ndarray, params: Any) -> None:
        values = await asyncio.gather(*(s[domain.index_exp].read() for s in stores))
        for name, v in zip(names[1:], values[1:]):
            if not np.array_equal(v, values[0]):
                raise ValueError(f"stored leaves that must hold the same value differ: {names[0]} holds "
                                 f"{np.asarray(values[0]).tolist()}, {name} holds {np.asarray(v).tolist()}")
        array[...] = values[0]

    return ts.virtual_chunked(read, loop=event_loop(), dtype=first.dtype, domain=first.domain, context=context())


def checked_cast(store: ts.TensorStore, wanted: str) -> ts.TensorStore:
    """A view of ``store`` as the logical dtype ``wanted``, cast by numpy chunk by chunk as the load casts
    (:mod:`xckpt.format.casts`): a stored value that ``wanted`` cannot hold (beyond its range, a NaN or an
    infinity into an integer, ...) fails the read with :class:`~xckpt.errors.KeyMismatchError`
    (``tree.key_mismatch``) instead of wrapping, as TensorStore's cast would."""
    stored = store.dtype.name
    to = dtypes.numpy_dtype(wanted)

    async def read(domain: ts.IndexDomain, array: np.ndarray, params: Any) -> None:
        values = np.asarray(await store[domain.index_exp].read())
        why = unfit(values, wanted)
        if why is not None:
            raise KeyMismatchError(f"the stored {stored} {why}, which the mapping's cast({wanted}) cannot hold; "
                                   f"cast to a wider dtype")
        array[...] = values.astype(to)

    if store.rank == 0:
        return ts.virtual_chunked(read, loop=event_loop(), dtype=ts.dtype(wanted), domain=store.domain,
                                  context=context())
    try:
        chunk = tuple(c or 1 for c in store.chunk_layout.read_chunk.shape)
    except Exception:  # noqa: BLE001 - a view without chunk information: chunks of a few MiB
        chunk = view_chunk_shape(tuple(store.shape), store.dtype.numpy_dtype.itemsize)
    return ts.virtual_chunked(read, loop=event_loop(), dtype=ts.dtype(wanted), domain=store.domain,
                              chunk_layout=ts.ChunkLayout(read_chunk_shape=chunk), context=context())
