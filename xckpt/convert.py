"""``xckpt convert``: checkpoints between formats, leaf by leaf (:mod:`xckpt.engine.copy`).

Converters of other formats are found through the ``xckpt.converters`` entry points
(:func:`xckpt.registry.converter`).
"""

from __future__ import annotations

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


def convert(src: str, dst: str, *, source: str = "xckpt", target: str = "xckpt", overwrite: bool = False) -> None:
    """Convert the checkpoint at ``src`` (format ``source``) to ``dst`` (format ``target``)."""
    fn = registry.converter(source, target)
    if fn is None:
        raise UnsupportedError(f"no converter from {source} to {target} is installed "
                               f"(formats known: {', '.join(registry.converter_formats())})",
                               code="convert.unsupported")
    fn(src, dst, overwrite=overwrite)
