"""Reading checkpoints that Orbax wrote (zarr v2/v3, OCDBT), as a stored-checkpoint source.

* :mod:`xckpt.interop.orbax.checkpoint`: one Orbax item (a directory holding ``_METADATA``) as a
  source (:func:`open_orbax`) and the ``orbax`` to ``xckpt`` converter, built on
  :mod:`xckpt.interop.orbax.metadata` (the ``_METADATA`` tree) and :mod:`xckpt.interop.orbax.arrays`
  (array metadata); :mod:`xckpt.interop.orbax.files` checks a local checkpoint's files (no links, no
  special files) before TensorStore opens any of them by path; :mod:`xckpt.interop.orbax.ocdbt`
  reads the per-process OCDBT databases of a multi-process save that were never merged.
* :mod:`xckpt.interop.orbax.layouts`: the layouts around items (Orbax v1 checkpoints,
  ``CheckpointManager`` step directories), found (:func:`~xckpt.interop.orbax.layouts.find_layout`)
  and opened as one source (a dict keyed by item name when there are several items).

What xckpt itself writes so that plain Orbax restores its checkpoints is part of the format:
:mod:`xckpt.format.orbax_view`.
"""
