"""Other formats: the files that let Orbax restore xckpt, and reading what Orbax wrote."""
