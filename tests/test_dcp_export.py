"""``xckpt convert --to dcp`` of trees DCP does not flatten: tuples (DCP pickles them whole) and namedtuples
(whose classes, rebuilt from a manifest, exist in no reader's program), read back by torch's own DCP code."""

from __future__ import annotations

import collections
import os
import warnings

import numpy as np
import pytest

import xckpt
import xckpt.convert

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


@pytest.mark.parametrize("to, extra, which", [
    ("dcp", [], "which are not DCP's own files"),
    ("safetensors", ["--select", "model"], "which are not its model.safetensors"),
    ("safetensors", ["--select", "model", "--max-shard-size", "8"], "which its index does not name")])
def test_a_refused_overwrite_of_an_export_says_what_names_its_files(tmp_path, to, extra, which):
    """save.foreign for an export names what tells its files (DCP's own file names, the index, the single
    file), not a manifest it does not have; a DCP export whose .metadata is cut short is refused the same way,
    deleting nothing."""
    xckpt.save({"model": {"w": np.ones(3, np.float32), "v": np.zeros(4, np.float32)}}, tmp_path / "ck")
    out = tmp_path / "out"
    assert cli(["convert", "--to", to, *extra, str(tmp_path / "ck"), str(out)]) == 0
    (out / "tokenizer.json").write_text("{}")
    if to == "dcp":
        (out / ".metadata").write_bytes((out / ".metadata").read_bytes()[:10])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    options = {"select": "model", "max_shard_size": 8 if "--max-shard-size" in extra else None} if extra else {}
    with pytest.raises(xckpt.XckptError) as info:
        xckpt.convert.convert(str(tmp_path / "ck"), str(out), target=to, overwrite=True, **options)
    assert (info.value.code, info.value.file) == ("save.foreign", str(out / "tokenizer.json")), info.value
    assert f"holds tokenizer.json, {which}" in str(info.value) and "manifest" not in str(info.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _map(tree, fn):
    """``tree`` with ``fn`` applied to each of its leaves, dicts, lists and tuples kept."""
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn) for v in tree)
    return fn(tree)


def _assert_same(got, want, where="") -> None:
    """``got`` holds ``want``'s containers and values, tensors compared element by element with their dtypes."""
    assert type(got) is type(want), where
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}/{i}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=where)
    else:
        assert got == want, where


def test_storage_reader_offers_exactly_the_names_dcp_flattens_to(tmp_path):
    """XckptStorageReader names what torch's own DCP save names for the same state (a list is asked for whole
    when no item is a tensor, dict or list DCP walks into: a list of tuples holding tensors is asked whole), and
    no name more (one more, such as a dict of values offered whole, makes DCP take the state for a torch 2.3
    one); DCP's load then fills every target with the stored data."""
    import torch.distributed.checkpoint as dcp
    from xckpt_torch import XckptStorageReader

    f = np.arange(6, dtype=np.float32)
    tree = {"opt": [(f[:3], 1), (f[3:] * 2, 2)],  # a list of tuples holding arrays: asked whole
            "cfg": {"lr": 0.5, "tags": ["a", "b"]},  # a dict of values: walked into, never asked whole
            "m": {"pair": (np.arange(4, dtype=np.int64), 7), "mu": [np.ones(2, np.float16)]},
            "mixed": [f[:2] + 9, (f[2:4], "x"), [1, 2], [[f[4:]]], {"d": np.array([5], np.int32)}],
            "vals": [1, [2, 3], (4, 5), None],
            "empty": [], "step": 3}
    xckpt.save(tree, tmp_path / "x")
    state = _map(tree, lambda x: torch.from_numpy(x.copy()) if isinstance(x, np.ndarray) else x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ..."
        dcp.save(state, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
        want = set(dcp.FileSystemReader(str(tmp_path / "plain")).read_metadata().state_dict_metadata)
        assert {"opt", "cfg.lr", "cfg.tags", "m.pair", "mixed.1", "mixed.3.0.0"} <= want
        assert set(XckptStorageReader(tmp_path / "x").read_metadata().state_dict_metadata) == want
        target = _map(state, lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else None)
        dcp.load(target, storage_reader=XckptStorageReader(tmp_path / "x"), no_dist=True)
    _assert_same(target, state)


def test_storage_reader_refuses_a_tuple_holding_an_array_torch_cannot_hold(tmp_path):
    """DCP asks for a tuple whole: one holding an array of a dtype torch lacks is dtype.unsupported naming the
    array's leaf and the checkpoint, before DCP gets anything (the target stays as it was); a load that does
    not ask for it reads the rest."""
    import ml_dtypes
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from xckpt_torch import XckptStorageReader

    xckpt.save({"pair": (np.ones(2, ml_dtypes.float8_e3m4), 7), "w": np.arange(3, dtype=np.float32)},
               tmp_path / "c")
    t = torch.full((2,), 5.0)
    target = {"pair": (t, 0), "w": torch.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException) as info:
            dcp.load(target, storage_reader=XckptStorageReader(tmp_path / "c"), no_dist=True)
        errors = [e for e, _ in info.value.failures.values()]
        assert [(e.code, e.leaf, e.file) for e in errors] == [("dtype.unsupported", "pair/0", str(tmp_path / "c"))]
        assert "float8_e3m4" in str(errors[0])
        assert target["pair"] == (t, 0) and torch.equal(t, torch.full((2,), 5.0)) and not target["w"].any()
        rest = {"w": torch.zeros(3)}
        dcp.load(rest, storage_reader=XckptStorageReader(tmp_path / "c"), no_dist=True)
    np.testing.assert_array_equal(rest["w"].numpy(), np.arange(3, dtype=np.float32))


def test_bytesio_values_through_the_storage_writer_and_reader(tmp_path):
    """DCP's own leaf type io.BytesIO (a data loader's state, say) saves through XckptStorageWriter as bytes
    (msgpack has no file objects), and DCP's load through XckptStorageReader gives a BytesIO back where the
    state dict holds one; tensors and values beside it compared element by element."""
    import io

    import torch.distributed.checkpoint as dcp
    from xckpt_torch import XckptStorageReader, XckptStorageWriter

    state = {"loader": io.BytesIO(b"\x00state\xff"), "nested": {"blobs": [io.BytesIO(b"a"), io.BytesIO(b"bc")]},
             "w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "step": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=XckptStorageWriter(tmp_path / "c"), no_dist=True)
        got = xckpt.load(tmp_path / "c")
        assert got["loader"] == b"\x00state\xff" and got["nested"]["blobs"] == [b"a", b"bc"] and got["step"] == 4
        target = {"loader": io.BytesIO(), "nested": {"blobs": [b"", b""]}, "w": torch.zeros(2, 3, dtype=torch.bfloat16),
                  "step": 0}
        dcp.load(target, storage_reader=XckptStorageReader(tmp_path / "c"), no_dist=True)
    assert isinstance(target["loader"], io.BytesIO) and target["loader"].getvalue() == b"\x00state\xff"
    assert target["nested"]["blobs"] == [b"a", b"bc"] and target["step"] == 4
    assert target["w"].dtype == torch.bfloat16 and torch.equal(target["w"], state["w"])


def _numpy_value_state(seed: int) -> dict:
    """A DCP state dict whose values hold numpy data and tensors (DCP pickles such values whole)."""
    import random
    return {"w": torch.arange(6.0).reshape(2, 3) * seed, "np_rng": np.random.RandomState(seed).get_state(),
            "arr": np.arange(4, dtype=np.int64) * seed, "be": np.arange(3, dtype=">f8") * seed,
            "empty": np.zeros((0, 3), np.float32) + seed, "lr": np.float32(seed) / 8,
            "pair": (torch.full((2,), float(seed)), torch.full((3,), seed, dtype=torch.bfloat16), seed),
            "py_rng": random.Random(seed).getstate()}


def test_numpy_data_in_values_through_the_storage_writer_and_reader(tmp_path):
    """Numpy data and tensors inside values DCP pickles whole (np.random.get_state(), a numpy scalar, a tuple of
    tensors) save through XckptStorageWriter as arrays, and DCP's load through XckptStorageReader gives numpy
    back as numpy (a scalar as a scalar), tensors as tensors: values and dtypes compared element by element."""
    import torch.distributed.checkpoint as dcp
    from xckpt_torch import XckptStorageReader, XckptStorageWriter

    want = _numpy_value_state(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(want, storage_writer=XckptStorageWriter(tmp_path / "c"), no_dist=True)
        assert xckpt.validate(tmp_path / "c", deep=True).ok
        stored = xckpt.load(tmp_path / "c")  # plain xckpt: arrays where the values held data
        np.testing.assert_array_equal(stored["np_rng"][1], want["np_rng"][1])
        assert stored["lr"].shape == () and stored["lr"].dtype == np.float32 and stored["lr"] == 0.375
        target = _numpy_value_state(0)
        dcp.load(target, storage_reader=XckptStorageReader(tmp_path / "c"), no_dist=True)
    for name in ("arr", "be", "empty"):
        assert type(target[name]) is np.ndarray and target[name].shape == want[name].shape, name
        assert target[name].dtype == want[name].dtype.newbyteorder("<"), name
        np.testing.assert_array_equal(target[name], want[name])
    assert type(target["lr"]) is np.float32 and target["lr"] == want["lr"]
    assert target["np_rng"][0] == "MT19937" and target["np_rng"][2:] == want["np_rng"][2:]
    assert type(target["np_rng"][1]) is np.ndarray and target["np_rng"][1].dtype == np.uint32
    np.testing.assert_array_equal(target["np_rng"][1], want["np_rng"][1])
    restored, original = np.random.RandomState(), np.random.RandomState(3)
    restored.set_state(target["np_rng"])
    np.testing.assert_array_equal(restored.randint(0, 2 ** 31, size=50), original.randint(0, 2 ** 31, size=50))
    for got, exp in zip(target["pair"][:2], want["pair"][:2]):
        assert isinstance(got, torch.Tensor) and got.dtype == exp.dtype and torch.equal(got, exp)
    assert target["pair"][2] == 3 and target["py_rng"] == want["py_rng"]
    torch.testing.assert_close(target["w"], want["w"], rtol=0, atol=0)


@pytest.mark.parametrize("value", [np.array([1, "a"], dtype=object), np.array(["text"]), (np.zeros(2, "M8[D]"),)],
                         ids=["object-array", "unicode-array", "datetime-in-tuple"])
def test_values_holding_data_xckpt_cannot_store_are_refused_by_name(tmp_path, value):
    """A value holding data no xckpt dtype holds is value.unsupported naming it; nothing is committed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from xckpt_torch import XckptStorageWriter

    with warnings.catch_warnings(), pytest.raises(CheckpointException) as info:
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "bad": value}, storage_writer=XckptStorageWriter(tmp_path / "c"), no_dist=True)
    errors = [e for e, _ in info.value.failures.values()]
    assert [(e.code, e.leaf) for e in errors] == [("value.unsupported", "bad")], errors
    assert not (tmp_path / "c").exists()


def test_an_array_asked_for_whole_that_declares_more_memory_than_there_is_is_named(tmp_path):
    """A tuple DCP asks for whole, whose array's manifest (and zarr.json) declare 2**42 float32 (16 TiB): the
    reader's allocation is refused as resource.too_large naming the leaf, not a bare MemoryError."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from xckpt_torch import XckptStorageReader

    path = tmp_path / "c"
    xckpt.save({"pair": (np.zeros(4, np.float32), 1)}, path)
    m = json.loads((path / "xckpt.json").read_text())
    entry = next(e for e in m["leaves"] if e["key"] == ["pair", 0])
    entry.update(shape=[2**42], chunk_shape=[2**42], inner_chunk_shape=[2**42],
                 sharding={"shard_shape": [2**42], "num_shards": 1})
    (path / "xckpt.json").write_text(json.dumps(m))
    z = json.loads((path / entry["path"] / "zarr.json").read_text())
    z["shape"] = z["chunk_grid"]["configuration"]["chunk_shape"] = [2**42]
    z["codecs"][0]["configuration"]["chunk_shape"] = [2**42]
    (path / entry["path"] / "zarr.json").write_text(json.dumps(z))
    target = {"pair": (torch.zeros(4), 0)}
    with warnings.catch_warnings(), pytest.raises(CheckpointException) as info:
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=XckptStorageReader(path), no_dist=True)
    errors = [e for e, _ in info.value.failures.values()]
    assert [(e.code, e.leaf) for e in errors] == [("resource.too_large", "pair/0")], errors
