"""``xckpt convert --to dcp`` of trees DCP does not flatten: tuples (DCP pickles them whole) and namedtuples
(whose classes, rebuilt from a manifest, exist in no reader's program), read back by torch's own DCP code."""

from __future__ import annotations

import collections
import os

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


def test_overwrite_keeps_what_was_put_into_an_export(tmp_path):
    """--overwrite replaces a DCP or safetensors export, never files put into it by hand (save.foreign);
    a safetensors export's config.json given to it (--hf-config) is its own, so it may be replaced."""
    xckpt.save({"model": {"w": np.ones(3, np.float32)}}, tmp_path / "ck")
    for to, extra in (("dcp", []), ("safetensors", ["--select", "model"])):
        out = tmp_path / to
        assert cli(["convert", "--to", to, *extra, str(tmp_path / "ck"), str(out)]) == 0
        (out / "NOTES.txt").write_text("mine")
        assert cli(["convert", "--to", to, *extra, "--overwrite", str(tmp_path / "ck"), str(out)]) == 2
        assert (out / "NOTES.txt").read_text() == "mine"
        (out / "NOTES.txt").unlink()
        assert cli(["convert", "--to", to, *extra, "--overwrite", str(tmp_path / "ck"), str(out)]) == 0
    from xckpt.interop.safetensors.writer import xckpt_to_safetensors
    conf = tmp_path / "config.json"
    conf.write_text('{"model_type": "gpt2"}')
    (tmp_path / "safetensors" / "config.json").write_text("{}")  # what an earlier --hf-config export wrote
    xckpt_to_safetensors(str(tmp_path / "ck"), str(tmp_path / "safetensors"), overwrite=True, select="model",
                         extra_files={"config.json": str(conf)})
    assert sorted(os.listdir(tmp_path / "safetensors")) == ["config.json", "model.safetensors"]
    assert (tmp_path / "safetensors" / "config.json").read_text() == '{"model_type": "gpt2"}'


def test_storage_reader_gives_dcp_tuples_with_arrays_and_names_what_torch_cannot_hold(tmp_path):
    """DCP asks for a tuple whole: XckptStorageReader builds it, arrays included; an array of a dtype torch
    lacks is left out of what DCP sees, with a warning naming it (DCP alone would say 'missing key')."""
    import ml_dtypes
    import torch.distributed.checkpoint as dcp
    from xckpt_torch import XckptStorageReader

    xckpt.save({"pair": (np.arange(3, dtype=np.float32), 7), "e3": np.ones(2, ml_dtypes.float8_e3m4)}, tmp_path / "c")
    target = {"pair": (torch.zeros(3), 0)}
    with pytest.warns(xckpt.XckptWarning, match=r"left out of what DCP sees: e3 \(float8_e3m4\)"):
        dcp.load(target, storage_reader=XckptStorageReader(tmp_path / "c"), no_dist=True)
    assert isinstance(target["pair"], tuple) and target["pair"][1] == 7
    np.testing.assert_array_equal(target["pair"][0].numpy(), np.arange(3, dtype=np.float32))
