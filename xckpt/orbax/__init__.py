"""Orbax interoperability, both ways.

* :mod:`xckpt.orbax.files`: the files an xckpt writer adds so plain Orbax restores its checkpoints.
* :mod:`xckpt.orbax.checkpoint`: reading checkpoints that Orbax wrote (zarr v2/v3, OCDBT), built on
  :mod:`xckpt.orbax.metadata` (the ``_METADATA`` tree) and :mod:`xckpt.orbax.arrays` (array metadata).
"""
