"""Hugging Face safetensors: reading (:mod:`~xckpt.interop.safetensors.checkpoint`) and writing
(:mod:`~xckpt.interop.safetensors.writer`).

* :mod:`xckpt.format.safetensors`: strict parsing of a file's header and of
  ``model.safetensors.index.json`` (every lie is a ``safetensors.*`` error, before any large allocation);
* :mod:`xckpt.interop.safetensors.checkpoint`: a directory (one file or sharded) or a single file
  opened as a :class:`~xckpt.sources.base.Source` (:func:`open_safetensors`), so ``xckpt.load`` reads
  it into any target, each process reading only the byte ranges its shards need; and the
  ``safetensors`` to ``xckpt`` converter (``xckpt convert --from safetensors``), offered here as
  :data:`CONVERTERS` (entry point ``xckpt.converters``: ``safetensors``).
"""

from __future__ import annotations

from xckpt.interop.safetensors.checkpoint import safetensors_to_xckpt
from xckpt.interop.safetensors.writer import xckpt_to_safetensors

#: The converters this package offers through the ``xckpt.converters`` entry point ``safetensors``.
CONVERTERS = {("safetensors", "xckpt"): safetensors_to_xckpt, ("xckpt", "safetensors"): xckpt_to_safetensors}
