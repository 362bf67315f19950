"""Pure name and layout maths of the torch <-> flax presets (no I/O, no frameworks).

* :func:`canon` puts a torch parameter name and a flax key in one form, so that
  ``transformer.h.0.attn.c_attn.weight`` and ``transformer/h/0/attn/c_attn/kernel`` (or
  linen's ``h_0``) meet: lower case, split at ``.``, ``/`` and ``_``, and the weight of a
  layer (torch ``weight``; flax ``kernel``, ``scale``, ``embedding``, ``weight``) one token.
* :func:`candidates` lists the layout changes that turn a torch parameter's shape into a
  flax leaf's shape: as stored, a transpose (``nn.Linear`` (out, in) <-> ``Dense`` (in, out)),
  the convolution permutation (OIHW <-> HWIO). A square weight fits two of them; the
  preset decides those by what the rest of the model shows, then by the layer's kind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

#: Flax leaf names that hold what torch calls a layer's ``weight``.
WEIGHT_NAMES = ("kernel", "scale", "embedding", "weight")
WEIGHT = "<weight>"
_SPLIT = re.compile(r"[._/]+")

#: Torch normalization buffers (batch statistics) and the flax ``batch_stats`` leaf names that hold them.
STATS = {"running_mean": "mean", "running_var": "var"}
#: Torch buffers flax keeps no counterpart of: BatchNorm's count of batches (used only without momentum), and
#: what flax computes from the configuration instead, which older Hugging Face checkpoints store (position
#: indices, rotary frequencies, relative position indices, GPT-2's attention ``masked_bias``; its causal mask
#: ``attn.bias`` is told by its rank, see :func:`torch_only`).
TORCH_ONLY = ("num_batches_tracked", "position_ids", "inv_freq", "relative_position_index", "masked_bias")
#: Module classes whose parameters flax computes instead of keeping (fixed sinusoidal position tables:
#: Marian, Pegasus, RoFormer), by a part of the class name.
TORCH_ONLY_CLASSES = ("Sinusoidal",)
#: Torch's weight normalization (``torch.nn.utils.parametrizations.weight_norm``) keeps a weight's magnitude
#: and direction as ``<module>.parametrizations.<name>.original0`` and ``original1``; flax (and torch's older
#: ``weight_norm``) name them ``<name>_g`` and ``<name>_v``.
WEIGHT_NORM = {"original0": "g", "original1": "v"}

#: Layer kinds the torch adapter records and the presets know: how the weight is laid out.
KINDS = ("linear", "linear_in_out", "embedding", "norm", "conv")


def tokens(component: str | int) -> tuple[str, ...]:
    """The tokens of one key component: ``"c_attn"`` -> ``("c", "attn")``, ``3`` -> ``("3",)``."""
    return tuple(t for t in _SPLIT.split(str(component).lower()) if t)


def torch_layer(fqn: str) -> tuple[str, str]:
    """(module name, leaf name) of a torch parameter or buffer; a weight-normalized one is named as flax names
    it: ``conv.parametrizations.weight.original0`` -> ``("conv", "weight_g")``."""
    module, _, leaf = fqn.rpartition(".")
    owner, _, name = module.rpartition(".")
    parent, _, holder = owner.rpartition(".")
    if leaf in WEIGHT_NORM and holder == "parametrizations":
        return parent, f"{name}_{WEIGHT_NORM[leaf]}"
    return module, leaf


def torch_only(leaf: str, rank: int, module_class: str) -> bool:
    """Whether flax keeps no counterpart of a torch parameter or buffer (``leaf`` of ``rank`` in a module of
    class ``module_class``, "" when unknown), computing it instead or not needing it: a name in
    :data:`TORCH_ONLY`, a module class in :data:`TORCH_ONLY_CLASSES`, or a ``bias`` of rank 3 or more, which
    is no layer's bias but an attention mask (GPT-2's ``attn.bias``)."""
    return leaf in TORCH_ONLY or any(c in module_class for c in TORCH_ONLY_CLASSES) or \
        (leaf == "bias" and rank >= 3)


def canon(module: Sequence[str | int], leaf: str, *, flax: bool) -> tuple[str, ...]:
    """The common form of a parameter: its module path's tokens, then its leaf's.

    ``module`` is the torch module name split at dots, or the flax key without its leaf. A
    name token repeated right after itself counts once: a linen module holding a list
    attribute of its own name (``layer/layer_0``) is torch's ``layer.0``, and a module named
    like its parent (``embedder.embedder``) is the same either way. A torch batch statistic
    (``running_mean``) is named as flax's (``mean``).
    """
    out: list[str] = []
    for c in module:
        for t in tokens(c):
            if not (out and t == out[-1] and not t.isdigit()):
                out.append(t)
    is_weight = leaf in WEIGHT_NAMES if flax else leaf == "weight"
    if is_weight:
        return tuple(out) + (WEIGHT,)
    return tuple(out) + tokens(leaf if flax else STATS.get(leaf, leaf))


def without_layer(canonical: tuple[str, ...]) -> list[tuple[int, tuple[str, ...]]]:
    """Each way of removing one layer index (a digit token) from a canonical name, with that index."""
    return [(int(t), canonical[:i] + canonical[i + 1:]) for i, t in enumerate(canonical[:-1]) if t.isdigit()]


@dataclass(frozen=True)
class Layout:
    """A layout change from a torch parameter to a flax leaf: a permutation of axes (None: as stored)."""

    perm: tuple[int, ...] | None
    name: str

    def inverse(self) -> "Layout":
        """The change from the flax leaf back to the torch parameter."""
        if self.perm is None:
            return self
        inv = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inv[p] = i
        return Layout(tuple(inv), self.name)

    def shape(self, torch_shape: Sequence[int]) -> tuple[int, ...]:
        """The flax shape of a torch parameter of ``torch_shape``."""
        return tuple(torch_shape) if self.perm is None else tuple(torch_shape[p] for p in self.perm)


SAME = Layout(None, "as stored")
TRANSPOSE = Layout((1, 0), "transposed")


def conv(rank: int) -> Layout:
    """torch ``(O, I, *K)`` -> flax ``(*K, I, O)``."""
    return Layout(tuple(range(2, rank)) + (1, 0), "OI* -> *IO")


def candidates(torch_shape: Sequence[int], flax_shape: Sequence[int], flax_leaf: str) -> list[Layout]:
    """The layout changes that turn ``torch_shape`` into ``flax_shape`` for a leaf named ``flax_leaf``."""
    rank = len(torch_shape)
    options = [SAME]
    if rank == 2 and flax_leaf != "embedding":
        options.append(TRANSPOSE)
    elif rank >= 3:
        options.append(conv(rank))
    return [o for o in options if o.shape(torch_shape) == tuple(flax_shape)]


def prior(kind: str | None, rank: int, flax_leaf: str) -> Layout | None:
    """The usual layout change for a torch layer of ``kind`` into a flax leaf (None: no usual one)."""
    if rank == 1 or flax_leaf == "embedding" or kind in ("embedding", "norm"):
        return SAME
    if kind == "linear" and rank == 2:
        return TRANSPOSE if flax_leaf == "kernel" else SAME
    if kind == "linear_in_out" and rank == 2:
        return SAME
    if kind == "conv" and rank >= 3:
        return conv(rank) if flax_leaf == "kernel" else SAME
    return None


def decide(options: list[Layout], seen: set[Layout], kind: str | None, rank: int, flax_leaf: str
           ) -> Layout | None:
    """Pick among several fitting layouts: the one that layers of the same class took, else the kind's usual one."""
    if len(options) == 1:
        return options[0]
    shown = [o for o in options if o in seen]
    if len(shown) == 1 and len(seen) == 1:
        return shown[0]
    usual = prior(kind, rank, flax_leaf)
    return usual if usual in options and not (seen - {usual}) else None
