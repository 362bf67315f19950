"""Reading checkpoints that Orbax wrote (zarr v2/v3, OCDBT), as a stored-checkpoint source.

* :mod:`xckpt.interop.orbax.checkpoint`: the source (:func:`open_orbax`) and the ``orbax`` to ``xckpt`` converter,
  built on :mod:`xckpt.interop.orbax.metadata` (the ``_METADATA`` tree) and :mod:`xckpt.interop.orbax.arrays`
  (array metadata); :mod:`xckpt.interop.orbax.files` checks a local checkpoint's files (no links, no
  special files) before TensorStore opens any of them by path.

What xckpt itself writes so that plain Orbax restores its checkpoints is part of the format:
:mod:`xckpt.format.orbax_view`.
"""
