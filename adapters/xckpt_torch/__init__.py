"""PyTorch adapter of xckpt (issue: PyTorch adapter). Not implemented yet."""
