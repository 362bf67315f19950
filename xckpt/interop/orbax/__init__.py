"""Orbax interoperability, both ways.

* :mod:`xckpt.interop.orbax.files`: the files an xckpt writer adds so plain Orbax restores its checkpoints.
* :mod:`xckpt.interop.orbax.checkpoint`: reading checkpoints that Orbax wrote (zarr v2/v3, OCDBT), built on
  :mod:`xckpt.interop.orbax.metadata` (the ``_METADATA`` tree) and :mod:`xckpt.interop.orbax.arrays` (array metadata).
"""
