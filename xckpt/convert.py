"""``xckpt convert``: checkpoints between formats, leaf by leaf (:mod:`xckpt.engine.copy`).

Converters of other formats are found through the ``xckpt.converters`` entry points
(:func:`xckpt.registry.converter`). A converter is ``fn(src, dst, *, overwrite=False, **options)``;
the options it takes are its own (``xckpt`` to ``safetensors``: ``select``, ``max_shard_size``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from xckpt import registry
from xckpt.engine.copy import copy_checkpoint
from xckpt.errors import UnsupportedError
from xckpt.sources.detect import open_checkpoint


def _xckpt_to_xckpt(src: str, dst: str, *, overwrite: bool = False) -> None:
    """Re-save a checkpoint as xckpt (a verified copy: every chunk is read and rewritten)."""
    ckpt = open_checkpoint(src)
    try:
        copy_checkpoint(ckpt, dst, overwrite=overwrite)
    finally:
        ckpt.close()


registry.register_converter("xckpt", "xckpt", _xckpt_to_xckpt)


def _check_options(fn: Callable[..., None], options: dict[str, Any], source: str, target: str) -> None:
    """Refuse options the converter does not take (``convert.option``), before it runs."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to check: the converter itself refuses
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in options if k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY]
    if unknown:
        takes = [k for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and k != "overwrite"]
        raise UnsupportedError(f"converting {source} to {target} takes no option {', '.join(map(repr, unknown))} "
                               f"(it takes: {', '.join(takes) or 'none'})", code="convert.option")


def convert(src: str, dst: str, *, source: str = "xckpt", target: str = "xckpt", overwrite: bool = False,
            **options: Any) -> None:
    """Convert the checkpoint at ``src`` (format ``source``) to ``dst`` (format ``target``).

    ``options`` go to the converter (``target="safetensors"``: ``select``, ``max_shard_size``); those
    given as None are left out, and one the converter does not take is refused (``convert.option``).
    """
    fn = registry.converter(source, target)
    if fn is None:
        pairs = ", ".join(f"{a} to {b}" for a, b in registry.conversions())
        raise UnsupportedError(f"xckpt does not convert {source} to {target} (it converts {pairs})",
                               code="convert.unsupported")
    options = {k: v for k, v in options.items() if v is not None}
    if options:
        _check_options(fn, options, source, target)
    fn(src, dst, overwrite=overwrite, **options)
