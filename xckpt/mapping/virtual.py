"""Views computed chunk by chunk in Python (``ts.virtual_chunked``), and the event loop they run on.

Their chunk callbacks are coroutines awaiting reads of the stored arrays, run on
an event loop of their own (a daemon thread), so a callback never blocks a
TensorStore thread that the stored read needs.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Sequence

import numpy as np
import tensorstore as ts

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The event loop that runs chunk callbacks (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="xckpt-mapping-views", daemon=True).start()
            _loop = loop
    return _loop


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
