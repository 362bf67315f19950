"""Stored checkpoints opened for reading, whatever wrote them, behind one Protocol.

:func:`xckpt.sources.detect.open_checkpoint` gives a :class:`~xckpt.sources.base.Source`:
an xckpt checkpoint (:mod:`xckpt.sources.native`) or one Orbax wrote
(:mod:`xckpt.interop.orbax.checkpoint`); a mapping (:mod:`xckpt.mapping`) wraps either in
a source with renamed keys and lazily transformed arrays. Loading, validation, conversion
and the DCP reader use nothing but this Protocol.
"""
