"""Stored checkpoints opened for reading, whatever wrote them, behind one Protocol."""
