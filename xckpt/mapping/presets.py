"""Ready-made mappings between PyTorch and flax/optax checkpoints, in both directions.

``torch_to_flax(...)`` and ``flax_to_torch(...)`` build a :class:`~xckpt.mapping.Mapping`
from the stored keys: every torch module with a ``weight``/``bias`` (under the
``model`` subtree) is paired with a flax module (under ``params``), by default by
name (``layers.0.attn.q`` <-> ``layers_0/attn/q`` for linen, ``layers/0/attn/q``
for nnx), or as ``modules`` says (patterns with captures, optionally with the
module kind). Kinds and their leaves:

========== ======================= ============================ ====================
kind       torch                   flax                         layout
========== ======================= ============================ ====================
linear     weight (out, in), bias  kernel (in, out), bias       transpose
embedding  weight (num, dim)       embedding (num, dim)         same
norm       weight, bias            scale, bias                  same (LayerNorm ...)
conv       weight (O, I, *K), bias kernel (*K, I, O), bias      OIHW <-> HWIO
========== ======================= ============================ ====================

A torch weight of rank 1 is a norm, rank 2 a linear layer (mark embeddings with
``("path", "embedding")`` in ``modules``), rank 3 or more a convolution; on the
flax side the leaf names tell. With ``optimizer`` the optimizer state follows every
parameter rule: torch Adam/AdamW ``exp_avg``/``exp_avg_sq`` <-> optax
``ScaleByAdamState`` ``mu``/``nu``, torch's per-parameter float ``step`` <-> optax's
int32 ``count`` (so bias correction continues exactly), SGD ``momentum_buffer`` <->
optax ``TraceState.trace``. Extra parameter ``rules`` given to a preset are
mirrored into the optimizer state the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping as TMapping, Sequence

from xckpt.format.manifest import ArrayEntry, Manifest
from xckpt.format.tree import Key, key_str
from xckpt.mapping.patterns import Pattern, parse_path, render
from xckpt.mapping.errors import MappingError
from xckpt.mapping.rules import Output, Rule, drop, rename, same
from xckpt.mapping.transforms import Transform, Transpose, cast
from xckpt.mapping.view import Mapping, RuleSource, match_rules


@dataclass(frozen=True)
class _Leaf:
    """A parameter of a module kind: its torch and flax names, and the layout change by rank."""

    torch: str
    flax: str
    to_flax: Callable[[int], Transform | None] = lambda rank: None
    to_torch: Callable[[int], Transform | None] = lambda rank: None


def _swap(rank: int) -> Transform:
    return Transpose((1, 0))


def _conv_to_flax(rank: int) -> Transform:
    return Transpose(tuple(range(2, rank)) + (1, 0))


def _conv_to_torch(rank: int) -> Transform:
    return Transpose((rank - 1, rank - 2) + tuple(range(rank - 2)))


#: The module kinds the presets know, with their leaves.
KINDS: dict[str, tuple[_Leaf, ...]] = {
    "linear": (_Leaf("weight", "kernel", _swap, _swap), _Leaf("bias", "bias")),
    "embedding": (_Leaf("weight", "embedding"),),
    "norm": (_Leaf("weight", "scale"), _Leaf("bias", "bias")),
    "conv": (_Leaf("weight", "kernel", _conv_to_flax, _conv_to_torch), _Leaf("bias", "bias")),
}
_ALIASES = {"dense": "linear", "embed": "embedding", "layernorm": "norm", "layer_norm": "norm",
            "groupnorm": "norm", "rmsnorm": "norm", "conv1d": "conv", "conv2d": "conv", "conv3d": "conv"}

#: Optimizer state fields: torch name -> optax name, per optimizer.
OPTIMIZERS: dict[str, tuple[tuple[str, str], ...]] = {
    "adam": (("exp_avg", "mu"), ("exp_avg_sq", "nu")),
    "adamw": (("exp_avg", "mu"), ("exp_avg_sq", "nu")),
    "sgd": (("momentum_buffer", "trace"),),
}


def _kind(name: str) -> str:
    k = _ALIASES.get(name.lower(), name.lower())
    if k not in KINDS:
        raise MappingError(f"unknown module kind {name!r}; known: {sorted(KINDS)} and {sorted(_ALIASES)}",
                           code="mapping.preset")
    return k


def _path(prefix: Any) -> Key:
    return parse_path(prefix) if isinstance(prefix, str) else tuple(prefix)


class TorchFlaxPreset(RuleSource):
    """The rules between a torch model/optimizer subtree and a flax params/optax subtree."""

    def __init__(self, to_flax: bool, modules: TMapping[str, str | tuple[str, str]] | None,
                 optimizer: str | None, rules: Sequence[Rule], naming: str, model: Any, optim: Any,
                 params: Any, opt_state: Any) -> None:
        if naming not in ("linen", "nnx"):
            raise MappingError(f"naming must be 'linen' or 'nnx', not {naming!r}", code="mapping.preset")
        if optimizer is not None and optimizer not in OPTIMIZERS:
            raise MappingError(f"optimizer must be one of {sorted(OPTIMIZERS)} or None, not {optimizer!r}",
                               code="mapping.preset")
        self.to_flax = to_flax
        self.optimizer = optimizer
        self.naming = naming
        self.user_rules = list(rules)
        self.model, self.optim = _path(model), _path(optim)
        self.params, self.opt_state = _path(params), _path(opt_state)
        self.modules: list[tuple[Pattern, Pattern, str | None]] = []
        for t, v in (modules or {}).items():
            f, kind = (v, None) if isinstance(v, str) else (v[0], _kind(v[1]))
            self.modules.append((Pattern(t), Pattern(f), kind))
        self.name = "torch_to_flax" if to_flax else "flax_to_torch"

    # -- parameters ---------------------------------------------------------------------------
    def rules_for(self, manifest: Manifest) -> list[Rule]:
        """Parameter rules (the user's, then generated ones), then optimizer rules."""
        params = self.user_rules + (self._torch_params(manifest) if self.to_flax else self._flax_params(manifest))
        if not params:
            where = key_str(self.model if self.to_flax else self.params)
            raise MappingError(f"{self.name}: no parameters found under {where!r}", code="mapping.no_match")
        return params + (self._optimizer_rules(manifest, params) if self.optimizer else [])

    def _torch_params(self, manifest: Manifest) -> list[Rule]:
        n = len(self.model)
        groups: dict[str, dict[str, ArrayEntry]] = {}
        for e in manifest.leaves:
            k = e.key
            if isinstance(e, ArrayEntry) and len(k) == n + 1 and k[:n] == self.model and isinstance(k[-1], str):
                module, _, leaf = k[-1].rpartition(".")
                groups.setdefault(module, {})[leaf] = e
        out = []
        for module, leaves in groups.items():
            weight = leaves.get("weight")
            flax_path, kind = self._flax_module(module)
            if kind is None:
                if weight is None:
                    continue
                rank = len(weight.shape)
                kind = "norm" if rank == 1 else "linear" if rank == 2 else "conv"
            for spec in KINDS[kind]:
                e = leaves.get(spec.torch)
                if e is None:
                    continue
                t = spec.to_flax(len(e.shape))
                out.append(rename(e.key, self.params + flax_path + (spec.flax,), *([t] if t else []),
                                  required=False, name=f"torch {kind} {module or '<root>'}.{spec.torch} -> "
                                                       f"flax {render(flax_path) or '<root>'}/{spec.flax}"))
        return out

    def _flax_params(self, manifest: Manifest) -> list[Rule]:
        n = len(self.params)
        groups: dict[Key, dict[str, ArrayEntry]] = {}
        for e in manifest.leaves:
            k = e.key
            if isinstance(e, ArrayEntry) and len(k) > n and k[:n] == self.params and isinstance(k[-1], str):
                groups.setdefault(k[n:-1], {})[k[-1]] = e
        out = []
        for path, leaves in groups.items():
            module, kind = self._torch_module(path)
            if kind is None:
                if "embedding" in leaves:
                    kind = "embedding"
                elif "scale" in leaves:
                    kind = "norm"
                elif "kernel" in leaves:
                    kind = "linear" if len(leaves["kernel"].shape) == 2 else "conv"
                else:
                    continue
            for spec in KINDS[kind]:
                e = leaves.get(spec.flax)
                if e is None:
                    continue
                t = spec.to_torch(len(e.shape))
                fqn = f"{module}.{spec.torch}" if module else spec.torch
                out.append(rename(e.key, self.model + (fqn,), *([t] if t else []), required=False,
                                  name=f"flax {kind} {render(path) or '<root>'}/{spec.flax} -> torch {fqn}"))
        return out

    def _flax_module(self, module: str) -> tuple[Key, str | None]:
        for t, f, kind in self.modules:
            caps = t.match((module,))
            if caps is not None:
                return f.format(caps), kind
        if not module:
            return (), None
        parts: list[Any] = []
        for c in module.split("."):
            if c.isdigit() and parts and self.naming == "linen":
                parts[-1] = f"{parts[-1]}_{c}"
            else:
                parts.append(int(c) if c.isdigit() and self.naming == "nnx" else c)
        return tuple(parts), None

    def _torch_module(self, path: Key) -> tuple[str, str | None]:
        for t, f, kind in self.modules:
            caps = f.match(path)
            if caps is not None:
                return render(t.format(caps)), kind
        parts = []
        for c in path:
            m = re.fullmatch(r"(.*[^_])_(\d+)", c) if isinstance(c, str) and self.naming == "linen" else None
            parts.extend([m.group(1), m.group(2)] if m else [str(c)])
        return ".".join(parts), None

    # -- optimizer state ----------------------------------------------------------------------
    def _optimizer_rules(self, manifest: Manifest, params: list[Rule]) -> list[Rule]:
        assert self.optimizer is not None
        state = self.optim + ("state",)
        out: list[Rule] = []
        for torch_field, optax_field in OPTIMIZERS[self.optimizer]:
            for r in params:
                if self.to_flax:
                    m = r.rerooted((self.model, state, (torch_field,)), (self.params, self.opt_state + (optax_field,),
                                                                          ()), f"{r.label} [{torch_field}]")
                else:
                    m = r.rerooted((self.params, self.opt_state + (optax_field,), ()),
                                   (self.model, state, (torch_field,)), f"{r.label} [{optax_field}]")
                if m is not None:
                    out.append(m)
        keys = [e.key for e in manifest.leaves]
        if self.to_flax:
            if not any(k[:len(state)] == state for k in keys):
                raise MappingError(f"torch_to_flax(optimizer={self.optimizer!r}): no optimizer state under "
                                   f"{key_str(state)!r}", code="mapping.no_match")
            steps = [k for k in keys if len(k) == len(state) + 2 and k[:len(state)] == state and k[-1] == "step"]
            if steps and self.optimizer in ("adam", "adamw"):
                out.append(same(steps, self.opt_state + ("count",), cast("int32"), required=False,
                                name="torch step of every parameter (all equal) -> optax count"))
            groups = self.optim + ("param_groups",)
            out.extend(drop(k, name="torch param_groups (hyperparameters live in the optax transformation)")
                       for k in keys if k[:len(groups)] == groups)
        else:
            if not any(k[:len(self.opt_state)] == self.opt_state for k in keys):
                raise MappingError(f"flax_to_torch(optimizer={self.optimizer!r}): no optax state under "
                                   f"{key_str(self.opt_state)!r}", code="mapping.no_match")
            count = self.opt_state + ("count",)
            if self.optimizer in ("adam", "adamw") and count in keys:
                fqns: list[Any] = []
                for mt in match_rules(manifest.leaves, params)[0]:
                    for o in mt.rule.outputs:
                        t = o.target.format(mt.captures)
                        if len(t) == len(self.model) + 1 and t[:len(self.model)] == self.model and t[-1] not in fqns:
                            fqns.append(t[-1])
                outs = tuple(Output(Pattern(state + (f, "step")), (cast("float32"),)) for f in fqns)
                out.append(Rule((Pattern(count),), outs, None, False, "optax count -> torch step of every parameter"))
        return out


def torch_to_flax(modules: TMapping[str, str | tuple[str, str]] | None = None, *, optimizer: str | None = None,
                  rules: Sequence[Rule] = (), naming: str = "linen", model: Any = "model", optim: Any = "optim",
                  params: Any = "params", opt_state: Any = "opt_state/0", passthrough: bool = True) -> Mapping:
    """Load a torch checkpoint into flax/optax targets.

    ``modules`` maps torch module paths to flax module paths (``{"layers.{i}.attn.q_proj":
    "layers_{i}/attn/q"}``, a value may be ``(path, kind)``); unmapped modules keep their
    names in the ``naming`` convention ("linen" or "nnx"). ``optimizer`` ("adam", "adamw",
    "sgd") maps the torch optimizer state under ``optim`` (as saved from
    ``get_optimizer_state_dict``) to the optax state node at ``opt_state`` (the
    ``ScaleByAdamState``/``TraceState``, e.g. ``"opt_state/0"`` for ``optax.adamw``).
    ``rules`` are extra parameter rules, tried first and mirrored into the optimizer state.
    """
    return Mapping(TorchFlaxPreset(True, modules, optimizer, rules, naming, model, optim, params, opt_state),
                   passthrough=passthrough)


def flax_to_torch(modules: TMapping[str, str | tuple[str, str]] | None = None, *, optimizer: str | None = None,
                  rules: Sequence[Rule] = (), naming: str = "linen", model: Any = "model", optim: Any = "optim",
                  params: Any = "params", opt_state: Any = "opt_state/0", passthrough: bool = True) -> Mapping:
    """Load a flax/optax checkpoint into torch targets (arguments as :func:`torch_to_flax`).

    ``modules`` still maps torch paths to flax paths. The optax ``count`` becomes the
    ``step`` of every torch parameter (a float32 scalar, as torch keeps it).
    """
    return Mapping(TorchFlaxPreset(False, modules, optimizer, rules, naming, model, optim, params, opt_state),
                   passthrough=passthrough)
