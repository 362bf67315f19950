"""Hook points the framework adapters and other packages plug into; the core itself knows only numpy.

* sources: turn a framework array into an :class:`ArraySource` (its local shards).
* targets: turn a load-target leaf into an :class:`ArrayTarget` (regions to read, how to build).
* containers: present a custom object (module, optimizer, pytree node) as a plain container,
  with optional notes about it (a torch module's layer classes), recorded at save time and
  shown to mappings at load time.
* coordinators: give the coordinator of a running distributed job.
* converters: turn a checkpoint of one format into another (``xckpt convert``).
* models: build the model a configuration file describes, without its weights, as the target
  a mapping renames a checkpoint for (``xckpt convert --to safetensors --hf-config``).
* commands: add a subcommand to the ``xckpt`` command line.

The core never imports these packages by name: they are found through entry points
(``pyproject.toml``): ``xckpt.adapters`` (name: the framework module, value: its adapter
module, imported once the framework is), ``xckpt.converters`` (name: a format, value: a
mapping ``{(source, target): function}``), ``xckpt.models`` (name: a kind of configuration,
value: a function from its path to the model), ``xckpt.commands`` (value: a :class:`Command`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from xckpt.engine.collective import Coordinator
from xckpt.engine.layout import MeshLayout
from xckpt.format.regions import Region

Matcher = Callable[[Any], bool]


@dataclass
class Shard:
    """A region of an array that this process holds, and how to get it as host numpy.

    ``prefetch``, if given, starts moving the data to the host without waiting (a
    device-to-host copy); the engine calls it for every shard this process writes
    before it fetches the first one.

    ``copy_into`` and ``host_buffer``, given together for data on an accelerator, let an
    asynchronous save copy the shard straight into a host buffer it keeps:
    ``host_buffer(nbytes)`` allocates a uint8 buffer the device copies into at full speed
    (page-locked memory), and ``copy_into(out)`` starts copying the shard into ``out`` (C
    order, the shard's shape and numpy dtype) and returns a function that waits until the copy
    is done. The engine starts every such copy before it waits for the first one.

    ``fetch_copies`` says that ``fetch()`` returns a host copy made for this save, which
    nothing else writes or frees (an accelerator's shard copied to host memory of its own): an
    asynchronous save keeps it as it is instead of copying it again before it returns.
    """

    region: Region
    fetch: Callable[[], np.ndarray]
    prefetch: Callable[[], None] | None = None
    copy_into: Callable[[np.ndarray], Callable[[], None]] | None = None
    host_buffer: Callable[[int], np.ndarray] | None = None
    fetch_copies: bool = False


@dataclass
class ArraySource:
    """An array leaf to save: global shape, logical dtype and this process's shards.

    ``layout`` (a :class:`~xckpt.engine.layout.MeshLayout`), where the framework knows one,
    says what every process holds, so planning needs no per-shard messages; this process's
    shards are then exactly the layout's pieces for its rank. Without a layout, replicas are
    listed by every process that holds them and the planner keeps one writer per region.
    ``sharding`` is the free-form description the manifest records.
    """

    shape: tuple[int, ...]
    dtype: str
    shards: Sequence[Shard]
    sharding: dict[str, Any] | None = None
    layout: MeshLayout | None = None


@dataclass
class ArrayTarget:
    """What a load target leaf asks for.

    ``regions`` are read from the stored array (in its coordinates) and converted to
    ``dtype`` (None: the stored dtype); ``build`` turns the list of numpy arrays, one
    per region, into the result leaf. ``shape`` is the global shape the target expects.
    ``out``, where given, returns for region ``i`` a writable host array of the region's
    shape and ``dtype`` to read into (a view of the target's own memory, for a load in
    place), or None; ``build`` then receives those very arrays.
    """

    shape: tuple[int, ...]
    dtype: str | None
    regions: Sequence[Region]
    build: Callable[[list[np.ndarray]], Any]
    out: Callable[[int], np.ndarray | None] | None = None


@dataclass
class Command:
    """A subcommand of the ``xckpt`` command line."""

    name: str
    help: str
    add_arguments: Callable[[Any], None]  # (argparse.ArgumentParser) -> None
    run: Callable[[Any], int]  # (argparse.Namespace) -> exit code


_sources: list[tuple[Matcher, Callable[[Any], ArraySource]]] = []
_targets: list[tuple[Matcher, Callable[[Any, Any], ArrayTarget]]] = []
_containers: list[tuple[Matcher, Callable[[Any], Any], Callable[[Any], tuple[Any, Callable[[Any], Any]]]]] = []
_notes: list[tuple[Matcher, Callable[[Any], dict[str, Any]]]] = []
_coordinators: list[Callable[[], Coordinator | None]] = []
_converters: dict[tuple[str, str], Callable[..., None]] = {}
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
    target tree and a function that turns the loaded plain tree into the result. That function
    may carry ``before_reading``, called with no argument by a load (not by a description of the
    target) before anything is read: it raises an :class:`~xckpt.errors.XckptError` to refuse the
    container as a target (a module on the meta device).
    """
    _containers.insert(0, (matches, save_view, load_view))


def register_notes(matches: Matcher, notes: Callable[[Any], dict[str, Any]]) -> None:
    """Register what to note about a custom container (JSON-able; e.g. a module's layer kinds).

    A save records the notes of every container it flattens in the manifest's
    ``metadata["xckpt.notes"]``; a load shows the target's notes to its mapping.
    """
    _notes.insert(0, (matches, notes))


def register_coordinator(factory: Callable[[], Coordinator | None]) -> None:
    """Register a factory returning the running job's coordinator, or None outside one."""
    _coordinators.insert(0, factory)


@functools.cache
def _entry_points(group: str) -> tuple[Any, ...]:
    """The installed entry points of ``group``, read once per process (reading them scans every package)."""
    return tuple(importlib.metadata.entry_points(group=group))


def adapters() -> dict[str, str]:
    """Framework module name -> its adapter module, as installed packages declare them."""
    return {ep.name: ep.value for ep in _entry_points("xckpt.adapters")}


def autoload() -> None:
    """Import the adapter of every framework the process has already imported."""
    for framework, module in adapters().items():
        if framework in sys.modules and module not in _loaded:
            _loaded.add(module)
            try:
                importlib.import_module(module)
            except ImportError:
                pass


def register_converter(source: str, target: str, fn: Callable[..., None]) -> None:
    """Register ``fn(src, dst, overwrite=...)`` converting format ``source`` to ``target``."""
    _converters[(source, target)] = fn


def converter(source: str, target: str) -> Callable[..., None] | None:
    """The converter from ``source`` to ``target``, loading the entry points that name either format."""
    if (source, target) not in _converters:
        for ep in _entry_points("xckpt.converters"):
            if ep.name in (source, target):
                for (a, b), fn in ep.load().items():
                    _converters.setdefault((a, b), fn)
    return _converters.get((source, target))


def conversions() -> list[tuple[str, str]]:
    """Every ``(source, target)`` pair an installed converter handles (loading every converter entry point)."""
    for ep in _entry_points("xckpt.converters"):
        for pair, fn in ep.load().items():
            _converters.setdefault(pair, fn)
    return sorted(_converters)


def converter_formats() -> list[str]:
    """Every format some installed converter reads or writes."""
    formats = {"xckpt"} | {ep.name for ep in _entry_points("xckpt.converters")}
    for a, b in _converters:
        formats.update((a, b))
    return sorted(formats)


def _named(group: str, name: str) -> Any:
    """What the installed entry point ``name`` of ``group`` names; None when none is installed, or when
    importing it fails (its framework is missing)."""
    for ep in _entry_points(group):
        if ep.name == name:
            try:
                return ep.load()
            except ImportError:
                return None
    return None


def model_builder(kind: str) -> Callable[[str], Any] | None:
    """The installed function that builds a model, weightless, from a configuration of ``kind`` (``hf``:
    a Hugging Face ``config.json``); None when no installed package provides one."""
    return _named("xckpt.models", kind)


def source_opener(kind: str) -> Callable[[Any], Any] | None:
    """The installed function that opens a stored checkpoint of another format ``kind`` for reading, from its
    :class:`~xckpt.engine.storage.Location` (``dcp``: a PyTorch DCP directory, with the torch adapter); None
    when no installed package provides one (or its framework is missing)."""
    return _named("xckpt.sources", kind)


def commands() -> list[Command]:
    """The subcommands installed packages add to the ``xckpt`` command line."""
    out = []
    for ep in _entry_points("xckpt.commands"):
        try:
            out.append(ep.load())
        except ImportError:
            continue
    return out


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


def notes_for(obj: Any) -> dict[str, Any] | None:
    """What the registered notes say about container ``obj``, or None."""
    return next((fn(obj) for m, fn in _notes if m(obj)), None)


def default_coordinator() -> Coordinator | None:
    """The coordinator of the distributed job this process is part of, if any."""
    for factory in _coordinators:
        coord = factory()
        if coord is not None:
            return coord
    return None
