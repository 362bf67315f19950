"""The on-disk format: names, dtypes, trees, the manifest, values, zarr metadata. Pure: no I/O."""
