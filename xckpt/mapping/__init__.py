"""Mapping layer: load a checkpoint into a target whose names and layouts differ.

``xckpt.load(path, like, mapping=m)`` applies ``m`` to the stored manifest before
anything is read. A mapping is an ordered list of rules (and presets producing
rules): rename keys with patterns that capture parts
(``"model/layers.{i}.weight"`` -> ``"params/layers_{i}/kernel"``), transform layouts
lazily (transpose, split of fused tensors, concatenation, reshape, casts)
as TensorStore views, so each process still reads only its own region's bytes.
Wrong mappings raise :class:`MappingError` before any data is read; target leaves
left unfilled and stored leaves left unused are reported by the load.

Ready-made, with no arguments: :func:`torch_to_flax` and :func:`flax_to_torch`, which
resolve names and layouts against the load target (see :mod:`xckpt.mapping.presets`).
"""

from xckpt.mapping.patterns import Pattern
from xckpt.mapping.layouts import KINDS
from xckpt.mapping.presets import MOMENTS, flax_to_torch, torch_to_flax
from xckpt.mapping.errors import MappingError
from xckpt.mapping.rules import Output, Rule, concat, drop, rename, same, split, stack
from xckpt.mapping.reshape import Reshape, reshape
from xckpt.mapping.target import Target, TargetLeaf
from xckpt.mapping.transforms import Cast, Index, Slice, Transform, Transpose, cast, transpose
from xckpt.mapping.view import Expansion, MappedCheckpoint, Mapping, RuleSource

__all__ = ["Mapping", "MappedCheckpoint", "MappingError", "Rule", "Output", "RuleSource", "Expansion", "Pattern",
           "rename", "split", "concat", "same", "stack", "drop", "transpose", "cast", "reshape",
           "Transform", "Transpose", "Slice", "Index", "Cast", "Reshape", "Target", "TargetLeaf",
           "torch_to_flax", "flax_to_torch", "KINDS", "MOMENTS"]
