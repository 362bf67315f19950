"""Ready-made mappings between PyTorch and flax/optax, resolved against the load target.

``xckpt.load(path, like, mapping=torch_to_flax())`` (or :func:`flax_to_torch`) needs no
arguments: the preset sees both trees before anything is read, the stored one and the
target (``like``), and pairs them up.

* **Which subtree is which.** The torch side is a state dict (``<root>/<fqn>``) and an
  optimizer state dict (``<root>/state/<fqn>/<field>``, ``<root>/param_groups``). The torch
  adapter notes each module's layer classes and tied parameters, at save time in the
  manifest (``metadata["xckpt.notes"]``) and at load time from the target module; without
  notes, a subtree of dotted names ending in ``.weight``/``.bias`` is taken for a state dict.
  Everything else is the flax side.
* **Names.** A flax leaf's key, less some leading components (its root: ``params``,
  ``opt_state/0/mu``, ...), must name a torch parameter once both are put in a common form
  (:func:`~xckpt.mapping.layouts.canon`: ``h.0.ln_1.weight`` = ``h/0/ln_1/scale`` =
  ``h_0/ln_1/scale``; linen, nnx, digit-string and integer module names alike). A root
  ending in ``mu``, ``nu`` or ``trace`` holds optax moments (torch ``exp_avg``,
  ``exp_avg_sq``, ``momentum_buffer``); any other root holds parameters. A flax leaf
  whose name matches a run of torch layers ``layers.{i}....`` with the layer index left out,
  and whose first axis counts them, is a scanned (stacked) array.
* **Layouts.** From the shapes: as stored, transposed (``nn.Linear`` (out, in) <-> ``Dense``
  (in, out)), or OI* <-> *IO (convolutions). A square weight fits two; it takes the layout the
  other layers of its class took in this model (GPT-2's ``Conv1D``), else its kind's usual one
  (noted by the adapter, or given in ``kinds``); otherwise the load fails before reading,
  listing the candidates and the hint that decides.
* **Optimizer state.** Moments follow their parameters through any optax chain (``chain``,
  ``inject_hyperparams``, ``masked``: a masked-out parameter's moments are left out); every
  optax ``count`` <-> torch's per-parameter ``step`` (all equal), so bias correction and
  schedules continue exactly; ``inject_hyperparams``' ``learning_rate``, ``b1``, ``b2``,
  ``eps``, ``weight_decay``, ``momentum`` <-> the torch param group's (one group). The rest
  of an optax state (``EmptyState``, clipping, schedule states) is not torch's to hold.
* **Tied weights.** A torch parameter tied to another (GPT-2's ``lm_head.weight``) is loaded
  from its partner's source, or left out when flax keeps only one copy.
* **Batch statistics.** BatchNorm's ``running_mean``/``running_var`` <-> flax
  ``batch_stats/.../mean``/``var`` (a root of their own).
* **What flax computes.** ``num_batches_tracked``, position indices (``position_ids``), rotary
  frequencies (``inv_freq``), GPT-2's attention masks (``attn.bias``, ``masked_bias``) and fixed
  sinusoidal position tables (Marian, Pegasus, RoFormer), which flax does not keep, are left out going
  to flax and keep the torch target's own coming back (:func:`~xckpt.mapping.layouts.torch_only`).
  Any other stored torch tensor that no flax leaf takes is reported, also when each tensor is a
  top-level key (a Hugging Face safetensors checkpoint).
* **Weight normalization.** torch's ``<module>.parametrizations.weight.original0``/``original1``
  <-> flax ``<module>/weight_g``/``weight_v`` (Wav2Vec2's positional convolution).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping as TMapping, Sequence

from xckpt.format.manifest import ArrayEntry, Manifest, ValueEntry
from xckpt.format.tree import Key, iter_nodes, key_str
from xckpt.mapping import layouts as L
from xckpt.mapping.errors import MappingError
from xckpt.mapping.patterns import Pattern
from xckpt.mapping.rules import Output, Rule, drop
from xckpt.mapping.target import Target
from xckpt.mapping.transforms import Index, Transform, Transpose, cast
from xckpt.mapping.view import Expansion, Mapping

#: optax moment fields and the torch optimizer state fields they hold.
MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum_buffer"}
#: ``inject_hyperparams`` names and where a torch param group keeps them.
HYPERPARAMS: dict[str, tuple[Any, ...]] = {"learning_rate": ("lr",), "b1": ("betas", 0), "b2": ("betas", 1),
                                           "eps": ("eps",), "weight_decay": ("weight_decay",),
                                           "momentum": ("momentum",)}

Shape = tuple[int, ...]


@dataclass
class TorchSide:
    """The torch state dict and optimizer state of one tree (stored or target)."""

    model: Key
    params: dict[str, Shape]
    kinds: dict[str, str] = field(default_factory=dict)  # module fqn -> layer kind
    classes: dict[str, str] = field(default_factory=dict)  # module fqn -> class
    tied: dict[str, str] = field(default_factory=dict)  # parameter fqn -> the parameter it shares
    optims: list[Key] = field(default_factory=list)
    state: set[Key] = field(default_factory=set)  # every optimizer state leaf key
    groups: set[Key] = field(default_factory=set)  # every param_groups leaf key

    def owns(self, key: Key) -> bool:
        """Whether ``key`` lies in the state dict or an optimizer state."""
        return key[:len(self.model)] == self.model and len(key) == len(self.model) + 1 or \
            any(key[:len(o)] == o for o in self.optims)

    def layer(self, fqn: str) -> tuple[str, str]:
        """(module name, leaf name) of a parameter (:func:`~xckpt.mapping.layouts.torch_layer`)."""
        return L.torch_layer(fqn)

    def torch_only(self, fqn: str) -> bool:
        """Whether flax keeps no counterpart of a parameter or buffer (:func:`~xckpt.mapping.layouts.torch_only`)."""
        module, leaf = self.layer(fqn)
        return L.torch_only(leaf, len(self.params[fqn]), self.classes.get(module, ""))


def _is_fqn(k: Any) -> bool:
    return isinstance(k, str) and "." in k and k.rsplit(".", 1)[1] in ("weight", "bias")


def torch_side(leaves: Sequence[tuple[Key, Shape | None]], notes: TMapping[Key, dict[str, Any]], what: str,
               where: str) -> TorchSide:
    """Find the torch state dict (and optimizer states) among ``leaves`` (key, shape); ``notes`` by key."""
    roots = [k for k, n in notes.items() if n.get("torch") == "module"]
    if not roots:
        under: dict[Key, list[Key]] = {}
        for key, _ in leaves:
            if key:
                under.setdefault(key[:-1], []).append(key)
        roots = [r for r, ks in under.items() if any(_is_fqn(k[-1]) for k in ks)
                 and all(isinstance(k[-1], str) for k in ks)]
    if not roots:
        raise MappingError(f"{what}: found no torch state dict (a subtree of parameter names such as "
                           f"'layer.weight') in the {where}", code="mapping.no_match")
    if len(roots) > 1:
        raise MappingError(f"{what}: several torch state dicts ({[key_str(r) for r in roots]}); load one at a "
                           f"time (select it in the target)", code="mapping.ambiguous")
    model = roots[0]
    n = notes.get(model, {})
    params = {k[-1]: tuple(s or ()) for k, s in leaves if len(k) == len(model) + 1 and k[:-1] == model
              and isinstance(k[-1], str)}
    side = TorchSide(model, params, dict(n.get("kinds", {})), dict(n.get("classes", {})), dict(n.get("tied", {})))
    for key, _ in leaves:
        if len(key) >= 4 and key[-2] in params and key[-3] == "state" and key[:-3] != model:
            o = key[:-3]
            if o not in side.optims:
                side.optims.append(o)
    for key, _ in leaves:
        for o in side.optims:
            if key[:len(o) + 1] == o + ("state",):
                side.state.add(key)
            elif key[:len(o) + 1] == o + ("param_groups",):
                side.groups.add(key)
    return side


@dataclass
class Found:
    """A flax leaf paired with torch parameters: its root, and one parameter or a stack of layers."""

    key: Key
    shape: Shape
    root: Key
    fqns: tuple[str, ...]  # one parameter, or the layers of a stacked leaf in order
    stacked: bool

    @property
    def moment(self) -> str | None:
        """The optax moment field the root holds (``mu``, ``nu``, ``trace``), or None for parameters."""
        return self.root[-1] if self.root and self.root[-1] in MOMENTS else None

    @property
    def stat(self) -> bool:
        """Whether it is a batch statistic (torch ``running_mean``/``running_var``, flax ``batch_stats``)."""
        return self.fqns[0].rpartition(".")[2] in L.STATS

    @property
    def param(self) -> bool:
        """Whether it is a parameter (not a moment, not a batch statistic)."""
        return self.moment is None and not self.stat


class _Index:
    """Torch parameters by their common-form names: whole, without their first module, without a layer index."""

    def __init__(self, side: TorchSide, modules: list[tuple[Pattern, Pattern]]) -> None:
        self.full: dict[tuple[str, ...], list[str]] = {}
        self.short: dict[tuple[str, ...], list[str]] = {}
        self.scan: dict[tuple[str, ...], dict[int, list[str]]] = {}
        for fqn in side.params:
            module, leaf = side.layer(fqn)
            parts: Sequence[Any] = module.split(".") if module else []
            for t, f in modules:
                caps = t.match((module,))
                if caps is not None:
                    parts = f.format(caps)
                    break
            c = L.canon(parts, leaf, flax=False)
            self.full.setdefault(c, []).append(fqn)
            if len(parts) > 1:
                self.short.setdefault(L.canon(parts[1:], leaf, flax=False), []).append(fqn)
            for i, reduced in L.without_layer(c):
                self.scan.setdefault(reduced, {}).setdefault(i, []).append(fqn)

    def find(self, key: Key, shape: Shape) -> Found | None:
        """The torch parameters a flax leaf names, trying its longest suffix first."""
        leaf, module = key[-1], key[:-1]
        if not isinstance(leaf, str):
            return None
        suffixes = [(s, L.canon(module[s:], leaf, flax=True)) for s in range(len(module) + 1)]
        for table in (self.full, self.short):
            for s, c in suffixes:
                hit = table.get(c)
                if hit and len(hit) == 1:
                    return Found(key, shape, key[:s], (hit[0],), False)
        for s, c in suffixes:
            layers = self.scan.get(c)
            if layers and shape and sorted(layers) == list(range(len(layers))) and shape[0] == len(layers) \
                    and all(len(v) == 1 for v in layers.values()):
                return Found(key, shape, key[:s], tuple(layers[i][0] for i in range(len(layers))), True)
        return None


def _empties(manifest: Manifest) -> set[Key]:
    """Keys of stored None values and empty containers (optax ``EmptyState``, ``MaskedNode``)."""
    out = {e.key for e in manifest.leaves if isinstance(e, ValueEntry) and e.type == "none"}
    out |= {k for k, node in iter_nodes(manifest.tree) if node["kind"] != "leaf" and not node["items"]}
    return out


def _masked_out(empties: set[Key], found: list[Found]) -> set[tuple[str, str]]:
    """(parameter, torch moment field) pairs whose place in an optax moment tree (a root ending in ``mu``,
    ``nu`` or ``trace``) is one of the ``empties`` (``optax.masked``'s ``MaskedNode``)."""
    rel = {f.fqns[0]: f.key[len(f.root):] for f in found if f.moment is None and not f.stacked}
    roots = {e[:i] for e in empties for i in range(1, len(e)) if e[i - 1] in MOMENTS}
    return {(fqn, MOMENTS[root[-1]]) for root in roots for fqn, r in rel.items() if root + r in empties}


def _transforms(layout: L.Layout, to_flax: bool) -> tuple[Transform, ...]:
    t = layout if to_flax else layout.inverse()
    return () if t.perm is None else (Transpose(t.perm),)


def _lifted(layout: L.Layout) -> tuple[Transform, ...]:
    """The layout of each layer applied to a stack of them (axis 0 is the layer)."""
    return () if layout.perm is None else (Transpose((0,) + tuple(p + 1 for p in layout.perm)),)


class TorchFlaxPreset:
    """The rules between a torch state dict/optimizer and a flax params/optax tree, either way."""

    def __init__(self, to_flax: bool, modules: TMapping[str, str] | None, kinds: TMapping[str, str] | None,
                 rules: Sequence[Rule]) -> None:
        self.to_flax = to_flax
        self.name = "torch_to_flax" if to_flax else "flax_to_torch"
        self.modules = [(Pattern(t), Pattern(f)) for t, f in (modules or {}).items()]
        self.kinds: list[tuple[Pattern, str]] = []
        for t, k in (kinds or {}).items():
            if k not in L.KINDS:
                raise MappingError(f"{self.name}: kind {k!r} of {t!r} is not one of {list(L.KINDS)}",
                                   code="mapping.preset")
            self.kinds.append((Pattern(t), k))
        self.user_rules = list(rules)

    # -- entry point ------------------------------------------------------------------------------
    def expand(self, manifest: Manifest, target: Target | None = None) -> Expansion:
        """The rules loading ``manifest`` into ``target`` (the user's, then the resolved ones), and the
        target keys the checkpoint may not hold (hyperparameters torch lacks, masked-out moments)."""
        if target is None:
            raise MappingError(f"{self.name}() resolves names and layouts against the load target: pass like=",
                               code="mapping.target")
        stored = [(e.key, tuple(e.shape) if isinstance(e, ArrayEntry) else None) for e in manifest.leaves]
        wanted = [(t.key, t.shape) for t in target.leaves if not t.empty]
        if self.to_flax:
            notes = {tuple(n["key"]): n for n in manifest.metadata.get("xckpt.notes", [])
                     if isinstance(n, dict) and isinstance(n.get("key"), list)}
            side = torch_side(stored, notes, self.name, "checkpoint")
            flax = [(k, s) for k, s in wanted if s is not None]
        else:
            side = torch_side(wanted, target.notes, self.name, "load target")
            flax = [(k, s) for k, s in stored if s is not None]
        index = _Index(side, self.modules)
        found = [f for k, s in flax if not side.owns(k) for f in [index.find(k, s)] if f is not None]
        if not found:
            raise MappingError(f"{self.name}: no {'target' if self.to_flax else 'stored'} flax leaf names a "
                               f"parameter of the torch state dict at {key_str(side.model)!r}",
                               code="mapping.no_match")
        decided = self._layouts(side, found)
        optional: set[Key] = set()
        body = self._to_flax(manifest, target, side, found, decided, optional) if self.to_flax else \
            self._to_torch(manifest, target, side, found, decided, optional)
        # a stored torch state dict is the preset's to map whole: a tensor no rule uses is reported, even where
        # each is a top-level key of its own (a Hugging Face safetensors checkpoint)
        claimed = {side.model + (q,) for q in side.params} if self.to_flax else set()
        return Expansion(self.user_rules + self._mirrored(side, found) + body, optional, claimed)

    # -- layouts ----------------------------------------------------------------------------------
    def _kind(self, side: TorchSide, module: str) -> str | None:
        for p, k in self.kinds:
            if p.match((module,)) is not None:
                return k
        return side.kinds.get(module)

    def _layouts(self, side: TorchSide, found: list[Found]) -> dict[tuple[str, str], L.Layout]:
        """The layout change of each (torch parameter, flax leaf name), decided once for all roots."""
        todo: dict[tuple[str, str], tuple[Found, list[L.Layout], tuple[Any, ...]]] = {}
        for f in found:
            fqn = f.fqns[0]
            shape = f.shape[1:] if f.stacked else f.shape
            module, leaf = side.layer(fqn)
            flax_leaf = str(f.key[-1])
            tshapes = {side.params[q] for q in f.fqns}
            if len(tshapes) > 1:
                raise MappingError(f"{self.name}: the layers stacked into {key_str(f.key)} differ in shape: "
                                   f"{sorted(tshapes)}", code="mapping.shape", leaf=key_str(f.key))
            tshape = side.params[fqn]
            options = L.candidates(tshape, shape, flax_leaf)
            if not options:
                raise MappingError(f"{self.name}: torch {fqn} {list(tshape)} does not fit flax {key_str(f.key)} "
                                   f"{list(f.shape)}{' (stacked)' if f.stacked else ''} as stored, transposed or "
                                   f"as a convolution", code="mapping.shape", leaf=key_str(f.key))
            group = (side.classes.get(module) or self._kind(side, module) or "?", leaf, flax_leaf, len(tshape))
            prev = todo.get((fqn, flax_leaf))
            if prev is None or len(options) < len(prev[1]):
                todo[(fqn, flax_leaf)] = (f, options, group)
        seen: dict[tuple[Any, ...], set[L.Layout]] = {}
        for f, options, group in todo.values():
            if len(options) == 1:
                seen.setdefault(group, set()).add(options[0])
        out: dict[tuple[str, str], L.Layout] = {}
        for (fqn, flax_leaf), (f, options, group) in todo.items():
            module, _ = side.layer(fqn)
            kind = self._kind(side, module)
            choice = L.decide(options, seen.get(group, set()), kind, len(side.params[fqn]), flax_leaf)
            if choice is None:
                names = ", ".join(o.name for o in options)
                raise MappingError(
                    f"{self.name}: torch {fqn} {list(side.params[fqn])} fits flax {key_str(f.key)} both {names}, and "
                    f"neither the other layers of its class ({group[0]}) nor a known layer kind decide; say what "
                    f"layer it is: {self.name}(kinds={{{module!r}: 'linear'}}) (weight (out, in); a flax kernel is "
                    f"(in, out)) or 'linear_in_out' (weight (in, out), Hugging Face Conv1D)",
                    code="mapping.ambiguous", leaf=key_str(f.key))
            out[(fqn, flax_leaf)] = choice
        return out

    # -- torch -> flax ----------------------------------------------------------------------------
    def _to_flax(self, manifest: Manifest, target: Target, side: TorchSide, found: list[Found],
                 decided: dict[tuple[str, str], L.Layout], optional: set[Key]) -> list[Rule]:
        stored = {e.key for e in manifest.leaves}
        outputs: dict[tuple[Key, ...], list[Output]] = {}
        labels: dict[tuple[Key, ...], str] = {}
        used: set[str] = set()
        for f in found:
            layout = decided[(f.fqns[0], str(f.key[-1]))]
            if f.moment is None:
                sources = tuple(side.model + (q,) for q in f.fqns)
            else:
                field_ = MOMENTS[f.moment]
                sources = ()
                for o in side.optims:
                    keys = tuple(o + ("state", q, field_) for q in f.fqns)
                    if all(k in stored for k in keys):
                        sources = keys
                        break
                if not sources:
                    continue  # the load reports the target leaf missing
            used.update(f.fqns)
            transforms = _lifted(layout) if f.stacked else _transforms(layout, True)
            outputs.setdefault(sources, []).append(Output(Pattern(f.key), transforms))
            labels[sources] = (f"torch {f.fqns[0]}{f' .. {f.fqns[-1]} stacked' if f.stacked else ''} -> flax "
                               f"{key_str(f.key)} ({layout.name})")
        rules = [Rule(tuple(Pattern(s) for s in srcs), tuple(outs), 0 if len(srcs) > 1 else None, False,
                      labels[srcs], stack=len(srcs) > 1) for srcs, outs in outputs.items()]
        rules += self._counts_to_flax(target, side, found, stored)
        rules += self._hyper_to_flax(target, side, optional)
        rules += [drop(side.model + (q,), name=f"torch {q}: tied to {side.tied[q]}")
                  for q in side.params if q not in used and q in side.tied]
        rules += [drop(side.model + (q,), name=f"torch {q}: flax keeps no counterpart")
                  for q in side.params if q not in used and side.torch_only(q)]
        rules += [drop(k, name="torch optimizer state of a parameter the optax state masks out")
                  for k in self._masked(target, side, found)]
        rules += [drop(k, name="torch param_groups (hyperparameters live in the optax transformation)")
                  for k in sorted(side.groups, key=key_str)]
        return rules

    def _counts_to_flax(self, target: Target, side: TorchSide, found: list[Found], stored: set[Key]) -> list[Rule]:
        tops = {f.root[:1] for f in found if f.moment} - {f.root[:1] for f in found if f.moment is None}
        counts = [t.key for t in target.leaves if t.key and t.key[-1] == "count" and t.key[:1] in tops
                  and not t.empty]
        # a TrainState's own step (beside its params) continues torch's, unless the checkpoint has one there
        beside = {f.root[:-1] for f in found if f.moment is None and f.root}
        counts += [t.key for t in target.leaves if t.key[-1:] == ("step",) and t.key[:-1] in beside
                   and t.shape in ((), None) and t.key not in stored]
        steps = sorted((k for k in side.state if k[-1] == "step"), key=key_str)
        if not steps:
            return []
        outs = tuple(Output(Pattern(k), (cast("int32"),)) for k in counts)
        return [Rule(tuple(Pattern(s) for s in steps), outs, None, False,
                     "torch step of every parameter (all equal) -> every optax count (and a TrainState's step)",
                     same=True)]

    def _hyper_to_flax(self, target: Target, side: TorchSide, optional: set[Key]) -> list[Rule]:
        rules: list[Rule] = []
        for t in target.leaves:
            if len(t.key) >= 2 and t.key[-2] == "hyperparams":
                optional.add(t.key)  # kept from the target where torch has no counterpart (eps_root)
                for o in side.optims if t.key[-1] in HYPERPARAMS else []:
                    groups = {k[len(o) + 1] for k in side.groups}
                    src = o + ("param_groups", 0) + HYPERPARAMS[t.key[-1]]
                    if groups == {0} and src in side.groups:
                        rules.append(Rule((Pattern(src),), (Output(Pattern(t.key)),), None, False,
                                          f"torch param group {key_str(src)} -> optax {key_str(t.key)}"))
                        break
        return rules

    def _masked(self, target: Target, side: TorchSide, found: list[Found]) -> list[Key]:
        """Torch moments of parameters whose place in an optax moment tree is an empty (masked) node."""
        pairs = _masked_out({t.key for t in target.leaves if t.empty}, found)
        return [k for k in side.state if k[-2:] in pairs]

    # -- flax -> torch ----------------------------------------------------------------------------
    def _to_torch(self, manifest: Manifest, target: Target, side: TorchSide, found: list[Found],
                  decided: dict[tuple[str, str], L.Layout], optional: set[Key]) -> list[Rule]:
        wanted = {t.key for t in target.leaves}
        for what, roots in (("parameters", {f.root for f in found if f.param}),
                            ("batch statistics", {f.root for f in found if f.stat})):
            if len(roots) > 1:
                raise MappingError(f"{self.name}: the checkpoint holds {what} under several roots "
                                   f"({sorted(key_str(r) for r in roots)}); load from one of them with a rule",
                                   code="mapping.ambiguous")
        per_field: dict[str, set[Key]] = {}
        for f in found:
            if f.moment:
                per_field.setdefault(f.moment, set()).add(f.root)
        for name, rs in per_field.items():
            if len(rs) > 1:
                raise MappingError(f"{self.name}: the optax state holds {name!r} under several roots "
                                   f"({sorted(key_str(r) for r in rs)})", code="mapping.ambiguous")
        for fqn, field_ in _masked_out(_empties(manifest), found):  # the torch optimizer keeps its own
            optional |= {o + ("state", fqn, field_) for o in side.optims}
        optional |= {side.model + (q,) for q in side.params if side.torch_only(q)}  # the target's own
        partners: dict[str, list[str]] = {}
        for q, first in side.tied.items():
            partners.setdefault(first, []).append(q)
        rules: list[Rule] = []
        for f in found:
            layout = decided[(f.fqns[0], str(f.key[-1]))]
            outs: list[Output] = []
            for i, fqn in enumerate(f.fqns):
                if f.moment is None:
                    keys = [side.model + (q,) for q in [fqn] + partners.get(fqn, [])]
                else:
                    keys = [o + ("state", fqn, MOMENTS[f.moment]) for o in side.optims]
                per = ((Index(0, i),) if f.stacked else ()) + _transforms(layout, False)
                outs += [Output(Pattern(k), per) for k in keys if k in wanted]
            if outs:
                rules.append(Rule((Pattern(f.key),), tuple(outs), None, False,
                                  f"flax {key_str(f.key)} -> torch {f.fqns[0]}"
                                  f"{f' .. {f.fqns[-1]} (one per layer)' if f.stacked else ''} ({layout.name})"))
        adam = sorted({f.root[:-1] for f in found if f.moment in ("mu", "nu")}, key=key_str)
        stored = {e.key: e for e in manifest.leaves}
        steps = [k for k in sorted(wanted, key=key_str) if k in side.state and k[-1] == "step"]
        if adam and steps and adam[0] + ("count",) in stored:
            rules.append(Rule((Pattern(adam[0] + ("count",)),), tuple(Output(Pattern(k), (cast("float32"),))
                                                                     for k in steps), None, False,
                              "optax count -> torch step of every parameter"))
        tops = {f.root[:1] for f in found if f.moment} - {f.root[:1] for f in found if f.moment is None}
        for key in stored:
            if len(key) >= 2 and key[-2] == "hyperparams" and key[-1] in HYPERPARAMS and key[:1] in tops:
                outs2 = [Output(Pattern(g[:len(o) + 2] + HYPERPARAMS[key[-1]])) for o in side.optims
                         for g in sorted({g[:len(o) + 2] for g in side.groups if g[:len(o) + 1] == o + ("param_groups",)},
                                         key=key_str) if g + HYPERPARAMS[key[-1]] in wanted]
                if outs2:
                    rules.append(Rule((Pattern(key),), tuple(outs2), None, False,
                                      f"optax {key_str(key)} -> torch param groups"))
        moments = {f.key for f in found if f.moment}
        rules += [drop(k, name="optax state torch keeps no counterpart of (EmptyState, schedule and clipping "
                               "states, masked-out nodes)")
                  for k in stored if k[:1] in tops and k not in moments]
        return rules

    # -- the user's rules, mirrored into the optimizer state -----------------------------------------
    def _mirrored(self, side: TorchSide, found: list[Found]) -> list[Rule]:
        if not self.user_rules:
            return []
        params = sorted({f.root for f in found if f.param}, key=key_str)
        moments = sorted({f.root for f in found if f.moment}, key=key_str)
        if len(params) != 1:
            return []
        out: list[Rule] = []
        for r in self.user_rules:
            for root in moments:
                field_ = MOMENTS[root[-1]]
                for o in side.optims:
                    if self.to_flax:
                        m = r.rerooted((side.model, o + ("state",), (field_,)), (params[0], root, ()))
                    else:
                        m = r.rerooted((params[0], root, ()), (side.model, o + ("state",), (field_,)))
                    if m is not None:
                        out.append(m)
        return out


def torch_to_flax(modules: TMapping[str, str] | None = None, *, kinds: TMapping[str, str] | None = None,
                  rules: Sequence[Rule] = (), passthrough: bool = True) -> Mapping:
    """Load a torch checkpoint (a state dict and optimizer state) into a flax/optax target.

    No argument is needed (see the module docstring). Hints, where the trees alone cannot
    decide: ``modules`` maps torch module names to flax module paths whose names differ
    (``{"tok_emb": "embed"}``, patterns with ``{captures}``); ``kinds`` says what layer a
    torch module is (``"linear"``, ``"linear_in_out"``, ``"embedding"``, ``"norm"``, ``"conv"``)
    where the checkpoint does not record it; ``rules`` are tried first (and mirrored into the
    optimizer moments).
    """
    return Mapping(TorchFlaxPreset(True, modules, kinds, rules), passthrough=passthrough)


def flax_to_torch(modules: TMapping[str, str] | None = None, *, kinds: TMapping[str, str] | None = None,
                  rules: Sequence[Rule] = (), passthrough: bool = True) -> Mapping:
    """Load a flax/optax checkpoint (xckpt or Orbax) into torch targets: a module and its optimizer.

    No argument is needed; the hints are those of :func:`torch_to_flax` (``modules`` still maps
    torch names to flax paths). Every optax ``count`` becomes the ``step`` of each torch parameter.
    """
    return Mapping(TorchFlaxPreset(False, modules, kinds, rules), passthrough=passthrough)
