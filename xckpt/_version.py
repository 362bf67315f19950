"""The version of the xckpt library (not of the format: see :data:`xckpt.format.manifest.VERSION`)."""

__version__ = "0.2.0"
