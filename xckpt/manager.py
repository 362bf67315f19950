"""A run's checkpoints, one per step: :func:`list_steps` and :class:`CheckpointManager`.

A *run* is a root directory holding one subdirectory per step, named by the step as a decimal
integer (``<root>/<step>/``, Orbax's default step naming; or, asked for as Orbax is, its
``step_format_fixed_length`` naming, zero-padded to that length: ``<root>/0010/``). The manager writes
each step as an Orbax ``CheckpointManager`` step: the xckpt checkpoint is the step's ``default`` item
(``<root>/<step>/default/``), and ``_CHECKPOINT_METADATA`` and ``commit_success.txt`` sit at
the top of the step (see the manager for why).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import json
import math
import operator
import os
import shutil
import signal
import stat
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from xckpt import registry
from xckpt.engine import atomic, background, claims, collective, steps
from xckpt.engine.collective import Coordinator, LocalCoordinator
from xckpt.engine.steps import METRICS_ITEM, json_object, regular
from xckpt.engine.storage import LocalStore, Location
from xckpt.engine.threads import Worker
from xckpt.errors import NotACheckpointError, SaveError, UnsupportedError, XckptError, XckptWarning
from xckpt.format import jsonobj, names, orbax_view
from xckpt.format.tree import key_str
from xckpt.load import load
from xckpt.save import save_async
from xckpt.sources.detect import open_checkpoint

__all__ = ["StepInfo", "list_steps", "step_of", "CheckpointManager"]



@dataclass(frozen=True)
class StepInfo:
    """One step of a run (see :func:`list_steps`)."""

    step: int
    #: The step's directory.
    path: str
    #: Whether it holds a complete checkpoint (xckpt's manifest, or Orbax's commit marker or commit time).
    committed: bool
    #: When it was committed, in seconds since the epoch: ``_CHECKPOINT_METADATA``'s
    #: ``commit_timestamp_nsecs``, else the manifest file's modification time; None when unknown.
    commit_time: float | None
    #: Bytes of the step's files (links are not followed); None if not computed.
    size_bytes: int | None
    #: Number of leaves of the checkpoint; None for an incomplete step.
    leaves: int | None
    #: Custom metrics recorded at save (empty if none).
    metrics: dict[str, Any] = field(default_factory=dict)
    #: ``"xckpt"`` or ``"orbax"``: who wrote the checkpoint; None for an incomplete step.
    format: str | None = None


def step_of(name: str, width: int | None = None) -> int | None:
    """The step a directory name stands for, else None: the canonical decimal form of an integer (Orbax's
    default naming: ``10``, not ``010``, whose step would have two directories), or with ``width`` Orbax's
    ``step_format_fixed_length=width`` naming (``0010``; a step of more digits has no leading zero)."""
    if not (name and name.isascii() and name.isdigit()):
        return None
    step = int(name)
    return step if name == _step_name(step, width) else None


def _step_name(step: int, width: int | None) -> str:
    """The directory name of ``step`` in a run whose step names have ``width`` digits at least (None: canonical)."""
    return f"{step:0{width}d}" if width else str(step)


def tree_size(path: str) -> int | None:
    """Bytes of the regular files below the directory ``path`` (no link is followed); None if unreadable."""
    try:
        store = LocalStore(path)
    except (OSError, XckptError):
        return None
    total = 0
    try:
        for name, kind in store.walk():
            if kind == "file":
                st = regular(os.path.join(path, name))
                total += st.st_size if st is not None else 0
    except (OSError, XckptError):
        return None
    finally:
        store.close()
    return total


def _step_info(step: int, path: str, *, sizes: bool = True) -> StepInfo:
    """What the step directory ``path`` holds."""
    meta = json_object(os.path.join(path, names.ORBAX_CHECKPOINT_METADATA))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            src = open_checkpoint(path)
    except (XckptError, OSError, ValueError):
        return StepInfo(step, path, False, None, tree_size(path) if sizes else None, None, {}, None)
    try:
        fmt = src.format
        leaves = len(src.manifest.leaves)
        manifest_meta = src.manifest.metadata if fmt == "xckpt" else {}
        item_loc = src.loc
    finally:
        src.close()
    if fmt not in RUN_FORMATS:  # another tool's files (a Hugging Face export in run/1000/): not a step's checkpoint,
        # so never the latest step, never deleted
        return StepInfo(step, path, False, None, tree_size(path) if sizes else None, None, {}, None)
    item = item_loc.local_path if item_loc.is_local else path
    item_meta = meta if meta is not None else json_object(os.path.join(item, names.ORBAX_CHECKPOINT_METADATA))
    manifest_file = os.path.join(item, names.MANIFEST)
    manifest_st = regular(manifest_file) if fmt == "xckpt" else None
    if fmt == "xckpt":
        committed = manifest_st is not None
    else:  # as Orbax decides: the commit marker, or a commit time recorded at finalisation; a step without
        # _CHECKPOINT_METADATA (older Orbax) exists only complete on a local file system (an atomic rename)
        committed = meta is None or regular(os.path.join(path, names.COMMIT)) is not None or \
            isinstance(meta.get("commit_timestamp_nsecs"), int)
    commit_time: float | None = None
    ts = (item_meta or {}).get("commit_timestamp_nsecs")
    if isinstance(ts, int) and not isinstance(ts, bool):
        commit_time = ts / 1e9
    elif manifest_st is not None:
        commit_time = manifest_st.st_mtime
    metrics: dict[str, Any] = {}
    mine = manifest_meta.get("manager") if isinstance(manifest_meta, dict) else None
    orbax_metrics = json_object(os.path.join(path, METRICS_ITEM, METRICS_ITEM))
    if isinstance(mine, dict) and isinstance(mine.get("metrics"), dict):
        metrics = _with_non_finite(mine["metrics"], mine.get("non_finite"))
    elif orbax_metrics is not None:
        metrics = orbax_metrics
    elif isinstance((meta or {}).get("metrics"), dict):
        metrics = dict(meta["metrics"])  # type: ignore[index]
    return StepInfo(step, path, committed, commit_time, tree_size(path) if sizes else None,
                    leaves if committed else None, metrics if committed else {}, fmt if committed else None)


#: The formats a run's step holds (:attr:`StepInfo.format`): what xckpt's and Orbax's ``CheckpointManager`` write.
RUN_FORMATS = ("xckpt", "orbax")

#: What :func:`_signature` looks at in a step directory, besides the directory itself and its item's.
_STEP_FILES = (names.ORBAX_CHECKPOINT_METADATA, names.COMMIT, names.MANIFEST, f"{METRICS_ITEM}/{METRICS_ITEM}")
#: ... and in the step's item directory (``default/``, or the step itself).
_ITEM_FILES = (names.MANIFEST, names.ORBAX_METADATA, names.ORBAX_CHECKPOINT_METADATA)


def _stat_key(path: str) -> tuple[int, int, int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _signature(path: str, item: str) -> tuple[Any, ...]:
    """What changes when the step directory ``path`` is replaced, or the files :func:`_step_info` reads in it or
    in its item directory ``item`` are added, replaced or removed (a committed step itself never changes)."""
    return (tuple(_stat_key(os.path.join(path, n)) for n in ("",) + _STEP_FILES)
            + tuple(_stat_key(os.path.join(item, n)) for n in ("",) + _ITEM_FILES))


def _step_dirs(root: str, width: int | None) -> list[tuple[int, str]]:
    """``(step, path)`` of every directory (not a link) under ``root`` named by a step (:func:`step_of` with
    ``width``), sorted by step."""
    try:
        with os.scandir(root) as it:
            entries = [(step_of(e.name, width), e) for e in it]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise XckptError(f"cannot list {root}: {exc.strerror}", code="io.read", file=root) from None
    return sorted((s, e.path) for s, e in entries if s is not None and e.is_dir(follow_symlinks=False))


def list_steps(root: str | os.PathLike[str], *, sizes: bool = True,
               step_format_fixed_length: int | None = None) -> list[StepInfo]:
    """Every step of the run at ``root``, sorted by step, incomplete ones included (``committed=False``).

    A step is a subdirectory (not a link) named by a decimal integer (:func:`step_of`: canonical, or with
    ``step_format_fixed_length=N`` zero-padded to ``N`` digits, as Orbax's option of that name writes them);
    it is committed when it
    holds a checkpoint xckpt opens (xckpt's own, at the top or as the ``default`` item, or an
    Orbax ``CheckpointManager`` step). What a save leaves beside its destination
    (``.<step>.xckpt-tmp-*``) is not a step. ``sizes=False`` skips walking the files
    (``size_bytes`` is then None). A missing root has no steps.
    """
    loc = Location.of(root)
    if not loc.is_local:
        raise UnsupportedError(f"{loc}: listing the steps of a run needs a local directory")
    width = _width(step_format_fixed_length)
    return [_step_info(step, path, sizes=sizes) for step, path in _step_dirs(loc.local_path, width)]


def _width(step_format_fixed_length: int | None) -> int | None:
    """``step_format_fixed_length`` checked: None, or a positive integer."""
    n = step_format_fixed_length
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"step_format_fixed_length must be a positive integer or None, not {n!r}")
    return n


def _item_dir(path: str) -> str:
    """The item directory of the step directory ``path`` that :func:`_signature` looks into: ``default/`` when
    there is one (a ``CheckpointManager`` step), else the step itself (a checkpoint at its top)."""
    item = os.path.join(path, names.DEFAULT_ITEM)
    st = _stat_key(item)
    return item if st is not None and stat.S_ISDIR(st[0]) else path


#: The longest name the manager gives a step's directory while it works on it (``.<step>.xckpt-deleting-<token>``).
_AUX_NAME_BYTES = len("..xckpt-deleting-") + 32


def _as_step(step: Any, width: int | None = None) -> int:
    """A step as a Python int: an ``int`` or an integer scalar of numpy, JAX or torch (``operator.index``), not a
    bool, not negative, and short enough to name the step's directories (``width``: the run's
    ``step_format_fixed_length``); else ValueError."""
    try:
        value = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        value = None
    if value is None or isinstance(value, bool) or value < 0:
        raise ValueError(f"a step is a non-negative integer, not {step!r}")
    value = int(value)
    if value.bit_length() > 1024 or len(_step_name(value, width)) + _AUX_NAME_BYTES > names.MAX_NAME_BYTES:
        shown = value if value.bit_length() <= 1024 else f"of {value.bit_length()} bits"
        raise ValueError(f"step {shown} is too large: its directories would be named by more than "
                         f"{names.MAX_NAME_BYTES - _AUX_NAME_BYTES} digits, longer than a file name may be")
    return value


# -- the manager -------------------------------------------------------------------------------------

#: The handler Orbax's ``CheckpointManager`` records for a single item saved with ``StandardSave``.
ORBAX_HANDLER = orbax_view.HANDLER
#: Orbax's ``CheckpointManager`` keeps a step's metrics as a JSON item ``metrics/metrics``, written by this handler.
ORBAX_METRICS_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
_BEST_MODES = ("max", "min")


def _non_finite_paths(value: Any, path: tuple[Any, ...] = ()) -> list[list[Any]]:
    """The paths (keys and list positions) of the NaN and infinite floats in plain metrics."""
    if isinstance(value, float) and not math.isfinite(value):
        return [list(path)]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _non_finite_paths(v, path + (k,))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _non_finite_paths(v, path + (i,))]
    return []


def _with_non_finite(metrics: dict[str, Any], paths: Any) -> dict[str, Any]:
    """Metrics read back from ``xckpt.json``: at each of ``paths`` (what :func:`_non_finite_paths` recorded at
    save), the string strict JSON wrote for a NaN or infinite float, as that float; a metric that was a
    string stays one. (A manifest an older xckpt wrote holds the floats themselves.)"""
    out = copy.deepcopy(metrics)
    for path in paths if isinstance(paths, list) else []:
        if not isinstance(path, list) or not path:
            continue
        node: Any = out
        try:
            for k in path[:-1]:
                node = node[k]
            if isinstance(node[path[-1]], str) and node[path[-1]] in jsonobj.NON_FINITE:
                node[path[-1]] = jsonobj.NON_FINITE[node[path[-1]]]
        except (KeyError, IndexError, TypeError):
            continue
    return out


def _plain(value: Any, key: tuple[Any, ...] = ()) -> Any:
    """A JSON-able copy of a metrics value (numpy and framework scalars become Python numbers); a value that
    is none of these is ``manager.metrics`` naming its key path (``hist/1``) as the leaf."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v, key + (k,)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, key + (i,)) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)
    what = f"the metric {key_str(key)!r}"
    if not callable(item):
        raise XckptError(f"{what} ({type(value).__name__}) is not a number, string, list or dict",
                         code="manager.metrics", leaf=key_str(key))
    try:
        got = item()
    except Exception as exc:  # noqa: BLE001 - numpy's ValueError, torch's RuntimeError for several elements, ...
        raise XckptError(f"{what} ({type(value).__name__}) is not one number ({exc})", code="manager.metrics",
                         leaf=key_str(key)) from None
    return _plain(got, key)


def _unreported(flight: "weakref.ref[_InFlight]", root: str) -> str | None:
    """What a step that failed in the background, and whose failure nobody was told, says at exit."""
    f = flight()
    if f is None or f.reported or f.error is None:
        return None
    return f"xckpt: CheckpointManager({root!r}) could not save step {f.step}, and nothing waited for it: {f.error}"


@dataclass
class _InFlight:
    """A save started by :meth:`CheckpointManager.save`, not yet finished on this process."""

    step: int
    staging: str
    thread: threading.Thread | None = None
    error: BaseException | None = None
    #: The last step saved before this one (what :meth:`CheckpointManager.should_save` compares with if it fails).
    previous: int | None = None
    #: The coordinating process's lease on the staged step (:func:`_step_lease`); None on the others.
    lease: claims.Lease | None = None
    #: Its outcome went to the caller (:meth:`CheckpointManager.wait` and the calls that finish it first), or
    #: was warned of (leaving a ``with`` block on an exception).
    reported: bool = False


#: The name the coordinating process's lease on a staged step is taken for (``.step.xckpt-lease-<token>`` in it).
STEP_LEASE = "step"


def _step_lease(staging: str, token: str) -> claims.Lease:
    """The coordinating process's lease on the staged step ``staging``, held from before its item is saved until
    the step is moved into place: the item's save releases its own lease once it commits, and a staged step
    whose process was killed between that commit and the move is then still known dead at once (it names a
    process of this machine that no longer runs: :func:`xckpt.engine.claims.scan_steps`), not after an hour."""
    try:
        os.makedirs(staging, exist_ok=True)
    except OSError as exc:
        raise SaveError(f"cannot make {staging}: {exc.strerror or exc}", code="io.write", file=staging) from exc
    lease = claims.Lease(Location(os.path.join(staging, STEP_LEASE)), token)
    try:
        lease.acquire()
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise SaveError(f"cannot write beside {staging}: {exc.strerror or exc}", code="io.write",
                        file=staging) from exc
    return lease


class CheckpointManager:
    """The checkpoints of one training run: when to save, saving in the background, what to keep, resuming.

    Every process of the job creates one over the same ``root`` and calls :meth:`should_save`,
    :meth:`save`, :meth:`wait`, :meth:`restore` and :meth:`close` alike (they agree through the
    job's coordinator: ``torch.distributed`` or ``jax.distributed`` when one is up, else this
    process alone). Step ``s`` is written to ``<root>/<s>/`` as an Orbax ``CheckpointManager``
    step: the xckpt checkpoint is the ``default`` item, ``_CHECKPOINT_METADATA`` and
    ``commit_success.txt`` are at the top, and the custom metrics are in Orbax's ``metrics`` item
    (and in the manifest's ``metadata["manager"]``). The step is written under a hidden name
    beside it (``.<s>.xckpt-step-<token>``) and moved into place once committed, so
    ``<root>/<s>/`` only ever appears complete. Creating a manager is collective too.

    When to save (:meth:`should_save`): every ``save_interval_steps`` steps, every
    ``save_interval_s`` seconds, and when a save was requested (:meth:`request_save`, or the
    signal ``preemption_signal`` when one is given: a handler is installed for it). Every
    process's decision is ORed, so all decide alike.

    What to keep, once a newer step committed: the last ``max_to_keep``, every step that is a
    multiple of ``keep_period``, the ``keep_best`` best by ``best_fn`` (a function of the
    metrics, or a metric's name; ``best_mode`` ``"max"`` or ``"min"``), and those committed
    less than ``keep_younger_than_s`` seconds ago. A step any of these keeps is kept; with none
    given, every step is. The newest committed step is always kept, a step being restored by
    this process is kept until the restore ends, and only committed checkpoints the manager
    recognises are ever deleted, by the coordinating process alone. Deleting a step removes what its
    save wrote (its manifest says what: :mod:`xckpt.engine.steps`); files put into it by hand are kept
    in ``<root>/<step>.xckpt-kept-<token>``, with a warning. A step Orbax wrote is deleted whole, as
    Orbax's own manager does.
    """

    def __init__(self, root: str | os.PathLike[str], *, save_interval_steps: int | None = None,
                 save_interval_s: float | None = None, preemption_signal: int | None = None,
                 max_to_keep: int | None = None, keep_period: int | None = None,
                 best_fn: Callable[[dict[str, Any]], float] | str | None = None, best_mode: str = "max",
                 keep_best: int | None = None, keep_younger_than_s: float | None = None,
                 async_save: bool = True, coordinator: Coordinator | None = None,
                 save_options: dict[str, Any] | None = None, step_format_fixed_length: int | None = None) -> None:
        """See the class documentation; ``save_options`` are passed to :func:`xckpt.save_async`
        (``compression``, ``commit_timeout_s``, ...). ``root`` must be a local directory.
        ``step_format_fixed_length=N`` names steps as Orbax's option of that name does (``0010`` for step 10
        with ``N=4``): for a run Orbax wrote so, and read so."""
        loc = Location.of(root)
        if not loc.is_local:
            raise UnsupportedError(f"{loc}: a checkpoint manager needs a local directory")
        for name, value in (("save_interval_steps", save_interval_steps), ("max_to_keep", max_to_keep),
                            ("keep_period", keep_period), ("keep_best", keep_best)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if best_mode not in _BEST_MODES:
            raise ValueError(f"best_mode must be 'max' or 'min', not {best_mode!r}")
        if keep_best is not None and best_fn is None:
            raise ValueError("keep_best needs best_fn (a function of the metrics, or a metric's name)")
        self.root = loc.local_path
        self.step_format_fixed_length = _width(step_format_fixed_length)
        self.save_interval_steps = save_interval_steps
        self.save_interval_s = save_interval_s
        self.max_to_keep = max_to_keep
        self.keep_period = keep_period
        self.best_fn: Callable[[dict[str, Any]], float] | None = (
            (lambda m, _k=best_fn: m[_k]) if isinstance(best_fn, str) else best_fn)
        self._best_key = best_fn if isinstance(best_fn, str) and keep_best is not None else None
        self.best_mode = best_mode
        self.keep_best = keep_best
        self.keep_younger_than_s = keep_younger_than_s
        self.async_save = async_save
        self.save_options = dict(save_options or {})
        if coordinator is None:
            registry.autoload()
            coordinator = registry.default_coordinator()
        self.coordinator: Coordinator = coordinator if coordinator is not None else LocalCoordinator()
        self._lock = threading.Lock()
        self._reading: dict[int, int] = {}  # step -> restores of it in progress in this process
        # step directory -> (its _signature, what it holds): committed steps read already (they never change)
        self._infos: dict[str, tuple[tuple[Any, ...], StepInfo]] = {}
        self._inflight: _InFlight | None = None
        self._requested = False  # a save was asked for on this process (request_save, or the signal)
        self._signalled = False  # the preemption signal arrived on this process
        self.preempted = False  # agreed: some process got the preemption signal
        self._decided: tuple[int, bool] | None = None
        self._last_time = time.monotonic()
        last = self.latest_step() if self.coordinator.rank == collective.ROOT else None
        if self.coordinator.world_size > 1:  # every process compares steps with the same last one
            last = collective.broadcast(self.coordinator, last, what=f"CheckpointManager({self.root!r})")
        self._last_step: int | None = last
        self._closed = False
        self._old_handler: Any = None
        self._signal = preemption_signal
        if preemption_signal is not None:
            self._old_handler = signal.signal(preemption_signal, self._on_signal)

    # -- when to save --------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled = True
        self._requested = True

    def request_save(self) -> None:
        """Ask for a save at the next :meth:`should_save` (on any one process: every process then agrees)."""
        self._requested = True

    def reached_preemption(self, step: int) -> bool:
        """Whether some process got the preemption signal (as agreed at the last :meth:`should_save`)."""
        return self.preempted

    def should_save(self, step: int) -> bool:
        """Whether to save ``step``, the same answer on every process (collective: every process calls it).

        True when a policy says so on any process (see the class documentation); False for a
        step not newer than the last one saved. Asking again for the same step gives the same answer (until
        it is saved: then False).
        """
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        if self._last_step is not None and step <= self._last_step:
            return False
        want = self._requested or (self.save_interval_steps is not None and step % self.save_interval_steps == 0) or \
            (self.save_interval_s is not None and time.monotonic() - self._last_time >= self.save_interval_s)
        if self.coordinator.world_size > 1:
            votes = collective.all_gather(self.coordinator, [bool(want), bool(self._signalled)],
                                         what=f"CheckpointManager.should_save({step})")
            want = any(v[0] for v in votes)
            self.preempted = self.preempted or any(v[1] for v in votes)
        else:
            self.preempted = self.preempted or self._signalled
        self._decided = (step, bool(want))
        return bool(want)

    # -- saving ----------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, force: bool = False, metrics: dict[str, Any] | None = None) -> bool:
        """Save ``state`` as ``step`` if :meth:`should_save` says so (always with ``force``); returns whether
        it did. Collective: every process calls it with its own part of ``state``.

        Asynchronous by default: returns once this process's part of the state is copied to the
        host; :meth:`wait` waits for the commit. ``metrics`` (numbers, strings, lists and dicts)
        are recorded with the step (the manifest's ``metadata["manager"]`` and Orbax's
        ``_CHECKPOINT_METADATA``) for :meth:`all_steps` and ``best_fn``; the coordinating
        process's are kept. A step that is already in ``root`` is an error (``manager.step_exists``).
        """
        self._check_open()
        # a numpy, JAX or torch integer as an int (it is recorded in the manifest)
        step = _as_step(step, self.step_format_fixed_length)
        if not force and not self.should_save(step):
            return False
        self._finish()  # the previous save: its outcome agreed on by every process
        coord = self.coordinator
        plain_metrics: dict[str, Any] = {}  # the coordinating process's are recorded; the others' are not read

        lease = None

        def plan() -> list[str]:  # on the coordinating process; whatever it raises is raised on every process
            nonlocal plain_metrics, lease
            plain_metrics, token = self._plan(step, metrics)
            lease = _step_lease(self._staging(step, token), token)
            return [token] * coord.world_size

        token = collective.answer_step(coord, f"CheckpointManager.save({step})",
                                       plan if coord.rank == collective.ROOT else None)
        if coord.rank == collective.ROOT and self._best_key is not None and self._best_key not in plain_metrics:
            warnings.warn(f"step {step} is saved without the metric {self._best_key!r} that best_fn ranks steps "
                          "by: keep_best will not keep it", XckptWarning, stacklevel=2)
        staging = self._staging(step, token)
        options = dict(self.save_options)
        metadata = dict(options.pop("metadata", None) or {})
        metadata["manager"] = {"step": step, "metrics": plain_metrics}
        floats = _non_finite_paths(plain_metrics)
        if floats:  # strict JSON writes them as strings: say which were floats (a metric "NaN" may be a string)
            metadata["manager"]["non_finite"] = floats
        started_ns = time.time_ns()
        try:
            handle = save_async(state, os.path.join(staging, names.DEFAULT_ITEM), coordinator=coord, metadata=metadata,
                                **options)
        except BaseException:
            if coord.rank == collective.ROOT:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        # its outcome is the manager's to report (wait()): claimed now, before the thread that waits for it
        # runs, so that an unrelated xckpt.save meanwhile does not raise this step's failure
        handle.claim()
        flight = _InFlight(step, staging, previous=self._last_step, lease=lease)
        flight.thread = Worker(lambda: self._finish_in_background(flight, handle, plain_metrics, started_ns),
                               "xckpt-manager-finish")
        with self._lock:
            self._inflight = flight
        self._last_step = step if self._last_step is None else max(self._last_step, step)  # (a forced older step)
        self._decided = None  # a step saved is not newer than the last one saved: asked again, it gives False
        self._last_time = time.monotonic()
        self._requested = False
        flight.thread.start()
        # a script that ends without wait() or close() still publishes; a failure is told on stderr then
        background.finish_at_exit(flight.thread, functools.partial(_unreported, weakref.ref(flight), self.root))
        if not self.async_save:
            self.wait()
        return True

    def _plan(self, step: int, metrics: Any) -> tuple[dict[str, Any], str]:
        """The coordinating process, before a save: the metrics as JSON-able values (a bad one is
        ``manager.metrics``, naming it), then :meth:`_prepare_step`; returns them and the staging token."""
        if metrics is not None and not isinstance(metrics, Mapping):
            raise XckptError(f"metrics are a dict, not {type(metrics).__name__}", code="manager.metrics",
                             file=self.step_path(step))
        try:
            plain = _plain(metrics or {})
        except XckptError as exc:
            raise exc.at(file=self.step_path(step)) from None
        return plain, self._prepare_step(step)

    def _staging(self, step: int, token: str) -> str:
        """Where step ``step`` is written before it is moved into place (``token``: this save's)."""
        return os.path.join(self.root, f".{step}.xckpt-step-{token}")

    def _prepare_step(self, step: int) -> str:
        """The coordinating process, before a save: make the root, remove dead leftovers, check the step is new;
        returns the staging token."""
        try:
            os.makedirs(self.root, exist_ok=True)
            self._remove_leftovers()
        except OSError as exc:
            raise XckptError(f"cannot prepare {self.root}: {exc}", code="io.write", file=self.root) from exc
        final = self.step_path(step)
        if os.path.lexists(final):
            raise XckptError(f"step {step} is already in {self.root}", code="manager.step_exists", file=final)
        return uuid.uuid4().hex

    def _finish_in_background(self, flight: _InFlight, handle: Any, metrics: dict[str, Any], started_ns: int) -> None:
        """Wait for the commit; on the coordinating process, move the step into place, then apply retention."""
        try:
            handle.wait()
            if self.coordinator.rank == collective.ROOT:
                if flight.lease is not None:
                    flight.lease.renew()  # fresh while the step is published, however long its item took to save
                self._publish(flight, metrics, started_ns)
        except BaseException as exc:  # noqa: BLE001 - raised by wait() on every process
            flight.error = exc
            if self.coordinator.rank == collective.ROOT:
                shutil.rmtree(flight.staging, ignore_errors=True)
            return
        if self.coordinator.rank == collective.ROOT:
            try:
                self._apply_retention()
            except Exception as exc:  # noqa: BLE001 - a step that could not be deleted is not a failed save
                warnings.warn(f"{self.root}: retention failed: {exc}", XckptWarning, stacklevel=1)

    def _publish(self, flight: _InFlight, metrics: dict[str, Any], started_ns: int) -> None:
        """Write the step's Orbax files into the staged step, sync it, move it to ``<root>/<step>``.

        Failures are specific: a file that cannot be written or synced is ``io.write`` (naming it), a step
        directory that appeared meanwhile is ``manager.step_exists`` (it is left as it is). The caller
        removes the staged step."""
        handlers = {names.DEFAULT_ITEM: ORBAX_HANDLER}
        if metrics:
            handlers[METRICS_ITEM] = ORBAX_METRICS_HANDLER
        meta = {"item_handlers": handlers, "metrics": metrics, "performance_metrics": {},
                "init_timestamp_nsecs": started_ns, "commit_timestamp_nsecs": time.time_ns(),
                "custom_metadata": {}}
        files = []
        if metrics:  # Orbax's metrics item, which its CheckpointManager reads for best_fn
            files += [(f"{METRICS_ITEM}/{METRICS_ITEM}", json.dumps(metrics).encode()),
                      (f"{METRICS_ITEM}/{names.COMMIT}", names.COMMIT_TEXT)]
        files += [(names.ORBAX_CHECKPOINT_METADATA, json.dumps(meta).encode()),
                  (names.COMMIT, names.COMMIT_TEXT)]
        store = LocalStore(flight.staging)
        try:
            for name, data in files:
                path = os.path.join(flight.staging, name)
                try:
                    store.write(name, data, atomic=True)
                except OSError as exc:
                    raise SaveError(f"cannot write {path}: {exc.strerror or exc}; step {flight.step} was not "
                                    "saved", code="io.write", file=path) from exc
            _synced(store.sync, flight.staging)
        finally:
            store.close()
        _synced(lambda: atomic.sync_dir(flight.staging), flight.staging)
        final = self.step_path(flight.step)
        if flight.lease is not None:
            flight.lease.release()  # the step goes into place without it
        try:
            atomic.move_new(flight.staging, final)
        except OSError as exc:  # FileExistsError; ENOTEMPTY: without renameat2, it appeared after the check
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise XckptError(f"step {flight.step} appeared in {self.root} while it was being saved (another "
                                 f"job or a user made {final}); it was left as it is and this save of the step "
                                 "was removed", code="manager.step_exists", file=final) from None
            raise SaveError(f"cannot move {flight.staging} to {final}: {exc.strerror or exc}; step {flight.step} "
                            "was not saved", code="io.write", file=final) from exc
        try:
            atomic.sync_dir(self.root)
        except OSError as exc:
            raise SaveError(f"step {flight.step} is in place at {final}, but {self.root} could not be synced "
                            f"({exc.strerror or exc}): it may not survive a crash", code="io.write",
                            file=self.root) from exc

    def _finish(self, *, agree: bool = True) -> None:
        """Wait for the save in flight (if any) and agree on its outcome with every process (``agree``)."""
        with self._lock:
            flight, self._inflight = self._inflight, None
        error: BaseException | None = None
        if flight is not None and flight.thread is not None:
            flight.thread.join()
            flight.reported = agree  # its failure is raised below (else once warned of, when leaving on another error)
            error = flight.error
        try:
            if not agree:
                if error is not None:
                    raise error
                return
            if self.coordinator.world_size > 1:
                collective.agree_step(self.coordinator, "checkpoint manager save", lambda: _reraise(error))
            elif error is not None:
                raise error
        except BaseException as exc:
            if flight is not None and self._last_step == flight.step:
                self._last_step = flight.previous  # not saved, on any process: every one may save it again
            if agree:
                raise
            warnings.warn(f"{self.root}: step {flight.step if flight else '?'} was not saved: {exc}", XckptWarning,
                          stacklevel=3)  # closing on an exception of the caller's: it goes on up, this is told
            if flight is not None:  # told (a warning turned into an error is not: the exit hook tells it then)
                flight.reported = True

    def wait(self) -> None:
        """Wait until the last save is committed and in place (collective); raise its failure on every process."""
        self._finish()

    def close(self) -> None:
        """Wait for the last save (collective), and put back the signal handler replaced at creation."""
        self._close(agree=True)

    def _close(self, *, agree: bool) -> None:
        if self._closed:
            return
        try:
            self._finish(agree=agree)
        finally:
            self._closed = True
            if self._signal is not None:
                signal.signal(self._signal, self._old_handler)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # leaving on an error, maybe on this process alone: no collective, and the error is the one raised
            self._close(agree=False)
        except Exception:  # noqa: BLE001
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise XckptError("the checkpoint manager is closed", code="manager.closed")

    # -- what is there -----------------------------------------------------------------------------

    def all_steps(self, *, sizes: bool = True) -> list[StepInfo]:
        """The committed steps in ``root``, oldest first, with commit time, size and metrics."""
        steps = [s for s in self._listing() if s.committed]
        return [replace(s, size_bytes=tree_size(s.path)) for s in steps] if sizes else steps

    def latest_step(self) -> int | None:
        """The newest committed step in ``root``, or None."""
        for step, path in reversed(_step_dirs(self.root, self.step_format_fixed_length)):
            if self._info(step, path).committed:
                return step
        return None

    def _info(self, step: int, path: str) -> StepInfo:
        """What the step directory ``path`` holds (:func:`_step_info`, sizes not computed). A committed step is
        read once: it never changes, and is read again only when its directory or the files read in it are
        replaced, added or removed (:func:`_signature`), so that a run of thousands of steps is not opened whole
        at each save's retention."""
        sig = _signature(path, _item_dir(path))
        with self._lock:
            hit = self._infos.get(path)
        if hit is not None and hit[0] == sig and hit[1].step == step:
            return hit[1]
        info = _step_info(step, path, sizes=False)
        with self._lock:
            if info.committed and _signature(path, _item_dir(path)) == sig:  # (unchanged while it was read)
                self._infos[path] = (sig, info)
            else:
                self._infos.pop(path, None)
        return info

    def _listing(self) -> list[StepInfo]:
        """Every step directory in ``root`` (:meth:`_info`), oldest first; forgets steps no longer there."""
        dirs = _step_dirs(self.root, self.step_format_fixed_length)
        infos = [self._info(step, path) for step, path in dirs]
        present = {path for _, path in dirs}
        with self._lock:
            for path in [p for p in self._infos if p not in present]:
                del self._infos[path]
        return infos

    def step_path(self, step: int) -> str:
        """The directory of ``step``: ``root/<step>`` (zero-padded with ``step_format_fixed_length``)."""
        return os.path.join(self.root, _step_name(step, self.step_format_fixed_length))

    def restore(self, step: int | None = None, like: Any = None, *, mapping: Any = None, **load_options: Any) -> Any:
        """Load ``step`` (None: the newest committed one, as the coordinating process sees it) with
        :func:`xckpt.load` (``like``, ``mapping`` and ``load_options`` are its own). Every process calls it.

        A run written by Orbax's ``CheckpointManager`` restores too. No committed step is
        ``manager.no_step``. Retention never deletes a step while this process restores it.
        """
        self._check_open()
        with contextlib.ExitStack() as held:
            if step is None:
                step = self._hold_latest(held) if self.coordinator.rank == collective.ROOT else None
                if self.coordinator.world_size > 1:
                    step = collective.broadcast(self.coordinator, step, what="CheckpointManager.restore")
                if step is None:
                    raise NotACheckpointError(f"{self.root} holds no committed step", code="manager.no_step",
                                              file=self.root)
            else:
                step = _as_step(step, self.step_format_fixed_length)
            path = held.enter_context(self.reading(step))
            return load(path, like, mapping=mapping, coordinator=self.coordinator, **load_options)

    def _hold_latest(self, held: contextlib.ExitStack) -> int | None:
        """The newest committed step, kept from retention (until ``held`` closes) before it could be deleted: a
        save in flight may commit a newer step, and its retention delete this one, while it is being chosen."""
        while True:
            step = self.latest_step()
            if step is None:
                return None
            self._hold(step)
            path = self.step_path(step)
            if os.path.isdir(path) and not os.path.islink(path):  # not deleted before it was held
                held.callback(self._release, step)
                return step
            self._release(step)

    def _hold(self, step: int) -> None:
        with self._lock:
            self._reading[step] = self._reading.get(step, 0) + 1

    def _release(self, step: int) -> None:
        with self._lock:
            self._reading[step] -= 1
            if not self._reading[step]:
                del self._reading[step]

    @contextlib.contextmanager
    def reading(self, step: int) -> Iterator[str]:
        """Keep ``step`` from being deleted by this manager while the block runs (what :meth:`restore` does);
        gives the step's directory, for reading its files some other way."""
        step = _as_step(step, self.step_format_fixed_length)
        self._hold(step)
        try:
            yield self.step_path(step)
        finally:
            self._release(step)

    # -- what to keep ------------------------------------------------------------------------------

    def _keeps_all(self) -> bool:
        return all(x is None for x in (self.max_to_keep, self.keep_period, self.keep_best, self.keep_younger_than_s))

    def steps_to_delete(self, steps: list[StepInfo] | None = None) -> list[int]:
        """The committed steps retention would delete now (see the class documentation)."""
        if self._keeps_all():
            return []
        if steps is None and self.keep_younger_than_s is None and self.keep_best is None:
            return self._by_position()
        committed = [s for s in (self._listing() if steps is None else steps) if s.committed]
        if len(committed) < 2:
            return []
        keep = {committed[-1].step}
        if self.max_to_keep is not None:
            keep.update(s.step for s in committed[-self.max_to_keep:])
        if self.keep_period is not None:
            keep.update(s.step for s in committed if s.step % self.keep_period == 0)
        if self.keep_younger_than_s is not None:
            now = time.time()
            keep.update(s.step for s in committed
                        if s.commit_time is None or now - s.commit_time < self.keep_younger_than_s)
        if self.keep_best is not None and self.best_fn is not None:
            scored = []
            for s in committed:
                try:  # the user's function on a step's metrics: a step it cannot score is not ranked (and the
                    # other rules still apply), whatever it raises
                    score = self.best_fn(s.metrics)
                    score = None if score is None else float(score)
                except Exception:  # noqa: BLE001
                    continue
                if score is not None and not math.isnan(score):
                    scored.append((score, s.step))
            scored.sort(key=lambda x: (-x[0] if self.best_mode == "max" else x[0], -x[1]))
            keep.update(step for _, step in scored[:self.keep_best])
        return [s.step for s in committed if s.step not in keep]

    def _by_position(self) -> list[int]:
        """:meth:`steps_to_delete` with only ``max_to_keep`` and ``keep_period``: what a step holds is read for the
        newest committed ones and for those neither rule keeps, not for the steps ``keep_period`` keeps."""
        dirs = _step_dirs(self.root, self.step_format_fixed_length)
        newest = max(1, self.max_to_keep or 1)
        kept, older = 0, len(dirs)
        while older and kept < newest:  # the newest committed step, and the last max_to_keep
            older -= 1
            kept += self._info(*dirs[older]).committed
        return [step for step, path in dirs[:older]
                if not (self.keep_period is not None and step % self.keep_period == 0)
                and self._info(step, path).committed]

    def _apply_retention(self) -> list[int]:
        """Delete what retention does not keep (the coordinating process); returns the steps deleted."""
        if self._keeps_all():
            return []
        with self._lock:
            busy = set(self._reading)
            if self._inflight is not None:
                busy.add(self._inflight.step)
        gone = []
        for step in self.steps_to_delete():
            if step in busy:
                continue
            with self._lock:  # (a restore holds the step first, or finds it gone)
                moved = None if step in self._reading else self._move_aside(step)
            if moved is not None:  # removed outside the lock: a restore of another step does not wait for it
                aside, fmt = moved
                steps.delete(aside, os.path.join(self.root, f"{step}.xckpt-kept-{aside.rpartition('-')[2]}"),
                             whole=fmt == "orbax")
                gone.append(step)
        return gone

    def _move_aside(self, step: int) -> tuple[str, str] | None:
        """Move a committed step out of the run (it leaves the listing at once); returns where it went, to be
        removed, and its format, or None when it is not a committed checkpoint the manager recognises, or cannot
        be moved."""
        path = self.step_path(step)
        info = _step_info(step, path, sizes=False) if os.path.isdir(path) and not os.path.islink(path) else None
        if info is None or not info.committed:
            return None  # only a committed checkpoint it recognises
        aside = os.path.join(self.root, f".{step}.xckpt-deleting-{uuid.uuid4().hex}")
        try:
            atomic.move_new(path, aside)
        except OSError:
            return None
        self._infos.pop(path, None)
        atomic.sync_dir(self.root)
        return aside, info.format or ""

    def _remove_leftovers(self) -> None:
        """Remove what dead saves left in ``root``: xckpt's stale leftovers, the manager's staged steps whose
        save is dead (no live lease inside and untouched for ``XCKPT_STALE_AFTER_S``; or, at once, a lease
        naming a process of this machine that no longer runs: a save killed here), unfinished deletions
        (:func:`xckpt.engine.claims.scan_steps`, the rule ``xckpt gc`` applies too); never this manager's
        own step in flight."""
        root = Location(self.root)
        claims.remove_stale(root)
        with self._lock:
            mine = self._inflight.staging if self._inflight is not None else None
        claims.remove_all(x for x in claims.scan_steps(root) if x.stale and x.path != mine)


def _synced(sync: Callable[[], None], path: str) -> None:
    """Run ``sync``; an OSError is ``io.write`` naming ``path`` (a SaveError naming its own file passes)."""
    try:
        sync()
    except OSError as exc:
        raise SaveError(f"cannot sync {path}: {exc.strerror or exc}", code="io.write", file=path) from exc


def _reraise(exc: BaseException | None) -> None:
    if exc is not None:
        raise exc
