"""JAX adapter of xckpt (issue: JAX adapter). Not implemented yet."""
