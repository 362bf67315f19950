"""``xckpt convert --to dcp`` of trees DCP does not flatten: tuples (DCP pickles them whole) and namedtuples
(whose classes, rebuilt from a manifest, exist in no reader's program), read back by torch's own DCP code."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import xckpt

torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from xckpt.cli import main as cli  # noqa: E402

Adam = collections.namedtuple("Adam", ["count", "mu", "nu"])


def test_tuples_and_namedtuples_reach_dcp_with_their_data(tmp_path):
    mu = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.full(3, 0.5, np.float32)}
    nu = {"w": np.ones((2, 3), np.float32) * 2, "b": np.zeros(3, np.float32)}
    tree = {"tup": (np.arange(3, dtype=np.float32), 5, {"inner": np.array([7, 8], np.int64)}),
            "opt": (Adam(np.int32(3), mu, nu), None),  # optax's state: a tuple of namedtuples
            "ns": Adam(np.int64(1), np.ones(2, np.float16), [np.zeros(1, np.float64)]),
            "plain": np.arange(4, dtype=np.int32)}
    xckpt.save(tree, tmp_path / "x")
    assert cli(["convert", "--to", "dcp", str(tmp_path / "x"), str(tmp_path / "dcp")]) == 0
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=False)

    def same(t, a):
        assert isinstance(t, torch.Tensor) and t.device.type == "cpu", t
        np.testing.assert_array_equal(t.numpy(), a)
        assert t.numpy().dtype == a.dtype

    assert isinstance(got["tup"], tuple) and len(got["tup"]) == 3 and got["tup"][1] == 5
    same(got["tup"][0], tree["tup"][0])
    same(got["tup"][2]["inner"], tree["tup"][2]["inner"])
    opt, none = got["opt"]
    assert none is None and sorted(opt) == ["count", "mu", "nu"]  # a namedtuple: the dict of its fields
    same(opt["count"], np.asarray(np.int32(3)))
    for name, want in (("mu", mu), ("nu", nu)):
        for k, a in want.items():
            same(opt[name][k], a)
    assert sorted(got["ns"]) == ["count", "mu", "nu"]  # outside a tuple, DCP stores each tensor on its own
    same(got["ns"]["count"], np.asarray(np.int64(1)))
    same(got["ns"]["mu"], tree["ns"].mu)
    same(got["ns"]["nu"][0], tree["ns"].nu[0])
    same(got["plain"], tree["plain"])
