"""The pure name and layout maths of the torch <-> flax presets, checked with hypothesis."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from xckpt.mapping import layouts as L

WORD = st.text(alphabet="abcdefgh", min_size=1, max_size=5)
PART = st.one_of(WORD, st.integers(0, 30))


@settings(max_examples=200, deadline=None)
@given(st.lists(PART, min_size=0, max_size=6), st.sampled_from(["weight", "bias"]))
def test_torch_linen_and_nnx_names_meet(parts, leaf):
    torch_name = ".".join(str(p) for p in parts)
    module = torch_name.split(".") if torch_name else []
    flax_leaf = {"weight": "kernel", "bias": "bias"}[leaf]
    nnx = tuple(parts)  # integer keys
    digits = tuple(str(p) for p in parts)  # digit-string module names (Hugging Face flax)
    linen: list[str] = []  # layers.0 -> layers_0
    for p in parts:
        if isinstance(p, int) and linen:
            linen[-1] = f"{linen[-1]}_{p}"
        else:
            linen.append(str(p))
    want = L.canon(module, leaf, flax=False)
    assert L.canon(nnx, flax_leaf, flax=True) == want
    assert L.canon(digits, flax_leaf, flax=True) == want
    assert L.canon(tuple(linen), flax_leaf, flax=True) == want


def test_weight_names_are_one_token_and_case_does_not_matter():
    assert L.canon(["encoder", "LayerNorm"], "weight", flax=False) == L.canon(("encoder", "layernorm"), "scale",
                                                                              flax=True)
    assert L.canon(["wte"], "weight", flax=False) == L.canon(("wte",), "embedding", flax=True)
    assert L.canon(["norm"], "weight", flax=False) == L.canon(("norm",), "weight", flax=True)  # Llama's RMSNorm
    assert L.canon(["x"], "bias", flax=False) != L.canon(("x",), "kernel", flax=True)



def test_a_list_attribute_inside_its_namesake_module_and_batch_statistics_meet():
    """linen's ``layer/layer_0`` (a list attribute named like its module) is torch's ``layer.0``; a module
    named like its parent counts once on both sides; indices never collapse (``0.0`` is not ``0``);
    torch's running statistics are flax's batch_stats names."""
    assert L.canon(["stages", 0, "layer", "layer_1", "conv"], "kernel", flax=True) == \
        L.canon("stages.0.layer.1.conv".split("."), "weight", flax=False)
    assert L.canon(["embedder", "embedder", "norm"], "mean", flax=True) == \
        L.canon(["embedder", "embedder", "norm"], "running_mean", flax=False) == ("embedder", "norm", "mean")
    assert L.canon(["layers", "0", "0"], "bias", flax=False) != L.canon(["layers", "0"], "bias", flax=False)
    assert L.canon(["bn"], "running_var", flax=False) == L.canon(["bn"], "var", flax=True)

@given(st.lists(PART, min_size=1, max_size=5))
def test_without_layer_drops_each_index_once(parts):
    c = L.canon([str(p) for p in parts], "weight", flax=False)
    out = L.without_layer(c)
    assert len(out) == sum(1 for t in c[:-1] if t.isdigit())
    for i, reduced in out:
        assert len(reduced) == len(c) - 1 and str(i) in c and reduced[-1] == L.WEIGHT


SHAPE = st.lists(st.integers(1, 6), min_size=1, max_size=5).map(tuple)


@settings(max_examples=300, deadline=None)
@given(SHAPE, st.sampled_from(["kernel", "scale", "embedding", "bias", "weight"]), st.integers(0, 2))
def test_candidates_are_exactly_the_layouts_that_fit(shape, leaf, pick):
    rank = len(shape)
    x = np.arange(int(np.prod(shape))).reshape(shape)
    layouts = [L.SAME] + ([L.TRANSPOSE] if rank == 2 and leaf != "embedding" else []) + \
        ([L.conv(rank)] if rank >= 3 else [])
    target = layouts[pick % len(layouts)]
    flax_shape = target.shape(shape)
    found = L.candidates(shape, flax_shape, leaf)
    assert target in found
    for lay in found:
        y = x if lay.perm is None else x.transpose(lay.perm)
        assert y.shape == flax_shape
        back = lay.inverse()
        np.testing.assert_array_equal(y if back.perm is None else y.transpose(back.perm), x)
    assert all(lay.shape(shape) == flax_shape for lay in found)
    assert (len(found) > 1) == (rank == 2 and leaf != "embedding" and shape[0] == shape[1] or
                                rank >= 3 and L.conv(rank).shape(shape) == shape)


def test_decide_prefers_what_the_model_shows_then_the_kind():
    both = [L.SAME, L.TRANSPOSE]
    assert L.decide([L.TRANSPOSE], set(), None, 2, "kernel") == L.TRANSPOSE
    assert L.decide(both, {L.TRANSPOSE}, "linear_in_out", 2, "kernel") == L.TRANSPOSE  # GPT-2's Conv1D in HF flax
    assert L.decide(both, set(), "linear", 2, "kernel") == L.TRANSPOSE
    assert L.decide(both, set(), "linear_in_out", 2, "kernel") == L.SAME
    assert L.decide(both, set(), None, 2, "kernel") is None
    assert L.decide(both, {L.SAME, L.TRANSPOSE}, None, 2, "kernel") is None
    assert L.decide(both, {L.SAME, L.TRANSPOSE}, "linear", 2, "kernel") is None  # the model contradicts itself
    assert L.decide([L.SAME, L.conv(3)], set(), "conv", 3, "kernel") == L.conv(3)
