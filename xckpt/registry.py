"""Hook points the framework adapters plug into; the core itself knows only numpy.

* sources: turn a framework array into an :class:`ArraySource` (its local shards).
* targets: turn a load-target leaf into an :class:`ArrayTarget` (regions to read, how to build).
* containers: present a custom object (module, optimizer, pytree node) as a plain container.
* coordinators: give the coordinator of a running distributed job.

Adapters are imported lazily, only when their framework is already imported.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from xckpt.engine.collective import Coordinator
from xckpt.engine.regions import Region

Matcher = Callable[[Any], bool]


@dataclass
class Shard:
    """A region of an array that this process holds, and how to get it as host numpy.

    ``prefetch``, if given, starts moving the data to the host without waiting (a
    device-to-host copy); the engine calls it for every shard this process writes
    before it fetches the first one.
    """

    region: Region
    fetch: Callable[[], np.ndarray]
    prefetch: Callable[[], None] | None = None


@dataclass
class ArraySource:
    """An array leaf to save: global shape, logical dtype and this process's shards.

    Replicas are simply listed by every process that holds them; the planner
    keeps one writer per distinct region.
    """

    shape: tuple[int, ...]
    dtype: str
    shards: Sequence[Shard]
    sharding: dict[str, Any] | None = None


@dataclass
class ArrayTarget:
    """What a load target leaf asks for.

    ``regions`` are read from the stored array (in its coordinates) and converted to
    ``dtype`` (None: the stored dtype); ``build`` turns the list of numpy arrays, one
    per region, into the result leaf. ``shape`` is the global shape the target expects.
    """

    shape: tuple[int, ...]
    dtype: str | None
    regions: Sequence[Region]
    build: Callable[[list[np.ndarray]], Any]


_sources: list[tuple[Matcher, Callable[[Any], ArraySource]]] = []
_targets: list[tuple[Matcher, Callable[[Any, Any], ArrayTarget]]] = []
_containers: list[tuple[Matcher, Callable[[Any], Any], Callable[[Any], tuple[Any, Callable[[Any], Any]]]]] = []
_coordinators: list[Callable[[], Coordinator | None]] = []
_ADAPTERS = {"torch": "xckpt_torch", "jax": "xckpt_jax"}
_loaded: set[str] = set()


def register_source(matches: Matcher, to_source: Callable[[Any], ArraySource]) -> None:
    """Register how to save leaves for which ``matches`` is true."""
    _sources.insert(0, (matches, to_source))


def register_target(matches: Matcher, to_target: Callable[[Any, Any], ArrayTarget]) -> None:
    """Register how to load into target leaves for which ``matches`` is true.

    ``to_target(like_leaf, entry)`` gets the stored :class:`~xckpt.format.manifest.ArrayEntry`.
    """
    _targets.insert(0, (matches, to_target))


def register_container(matches: Matcher, save_view: Callable[[Any], Any],
                       load_view: Callable[[Any], tuple[Any, Callable[[Any], Any]]]) -> None:
    """Register a custom container.

    ``save_view(obj)`` gives the plain tree to save; ``load_view(obj)`` gives the plain
    target tree and a function that turns the loaded plain tree into the result.
    """
    _containers.insert(0, (matches, save_view, load_view))


def register_coordinator(factory: Callable[[], Coordinator | None]) -> None:
    """Register a factory returning the running job's coordinator, or None outside one."""
    _coordinators.insert(0, factory)


def autoload() -> None:
    """Import the adapter of every framework the process has already imported."""
    for framework, module in _ADAPTERS.items():
        if framework in sys.modules and module not in _loaded:
            _loaded.add(module)
            try:
                importlib.import_module(module)
            except ImportError:
                pass


def source_for(obj: Any) -> Callable[[Any], ArraySource] | None:
    """The registered source maker for ``obj``."""
    return next((fn for m, fn in _sources if m(obj)), None)


def target_for(obj: Any) -> Callable[[Any, Any], ArrayTarget] | None:
    """The registered target maker for ``obj``."""
    return next((fn for m, fn in _targets if m(obj)), None)


def save_view(obj: Any) -> Any | None:
    """The plain container a registered custom container saves as, or None."""
    return next((sv(obj) for m, sv, _ in _containers if m(obj)), None)


def load_view(obj: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """The plain target tree and rebuild function of a registered container, or None."""
    return next((lv(obj) for m, _, lv in _containers if m(obj)), None)


def default_coordinator() -> Coordinator | None:
    """The coordinator of the distributed job this process is part of, if any."""
    for factory in _coordinators:
        coord = factory()
        if coord is not None:
            return coord
    return None
