"""``xckpt convert --from dcp`` trusts nothing in the DCP checkpoint it reads.

Real checkpoints written by ``torch.distributed.checkpoint.save`` (``FileSystemWriter``)
are converted exactly; crafted ``.metadata`` pickles never run code, build only DCP's
own classes, and must yield a ``Metadata``; links, FIFOs and out-of-range or escaping
storage entries are refused before anything outside the checkpoint is read.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import threading
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, ChunkStorageMetadata,  # noqa: E402
                                                   Metadata, MetadataIndex, StorageMeta)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType  # noqa: E402

import xckpt  # noqa: E402
from xckpt.convert import convert  # noqa: E402
from xckpt.errors import XckptError  # noqa: E402
from xckpt_torch import dcp_metadata  # noqa: E402
from xckpt_torch.staging import to_host  # noqa: E402

from opened import Opened, probe  # noqa: E402

pytestmark = pytest.mark.usefixtures("every_checkpoint_validates")

BIG_ROWS = 7


class _SplitPlanner(DefaultSavePlanner):
    """Stores ``fqn`` as two chunks split along ``dim`` at ``at`` (``big``: rows 0-2 and 3-6), as a sharded
    (DTensor) save would."""

    def __init__(self, fqn: str = "big", dim: int = 0, at: int = 3) -> None:
        super().__init__()
        self.fqn, self.dim, self.at = fqn, dim, at

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for it in plan.items:
            if it.index.fqn != self.fqn:
                items.append(it)
                continue
            td = it.tensor_data
            for start, n in ((0, self.at), (self.at, td.size[self.dim] - self.at)):
                off, sz = [0] * len(td.size), list(td.size)
                off[self.dim], sz[self.dim] = start, n
                off, sz = torch.Size(off), torch.Size(sz)
                items.append(WriteItem(MetadataIndex(self.fqn, off), WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(ChunkStorageMetadata(off, sz), td.properties,
                                                                   td.size)))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        if write_item.index.fqn == self.fqn:
            c = write_item.tensor_data.chunk
            return self.state_dict[self.fqn].narrow(self.dim, c.offsets[self.dim], c.sizes[self.dim]).clone()
        return super().resolve_data(write_item)


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    f = torch.randn(3, 4, generator=g)
    f[0, 0], f[0, 1], f[0, 2] = float("nan"), float("inf"), -0.0
    return {
        "f32": f,
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "bf16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, generator=g).to(torch.float16),
        "i64": torch.arange(-3, 3, dtype=torch.int64) * (2 ** 40),
        "i32": torch.tensor([-(2 ** 31), 2 ** 31 - 1], dtype=torch.int32),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "b": torch.tensor([True, False, True]),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "big": torch.arange(BIG_ROWS * 5, dtype=torch.float32).reshape(BIG_ROWS, 5),
        "step": 12,
        "name": "hostile-test",
        "cfg": {"lr": 0.5, "betas": (0.9, 0.99), "tags": ["a", "b"]},
    }


def _save(path, *, single_file: bool = True) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(_state(), storage_writer=FileSystemWriter(str(path), single_file_per_rank=single_file),
                 planner=_SplitPlanner(), no_dist=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A real DCP checkpoint (one data file), written once."""
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    _save(path)
    return path


@pytest.fixture()
def ckpt(base, tmp_path):
    """A private copy of the real checkpoint, to tamper with."""
    path = tmp_path / "ckpt"
    shutil.copytree(base, path)
    return path


def _convert(src, dst) -> None:
    convert(str(src), str(dst), source="dcp")


def _fails(src, dst, code: str, in_place: str | None = None) -> XckptError:
    """Converting ``src`` fails with ``code``, and nothing is committed at ``dst``; loading it in place fails
    alike (the same reader; ``in_place``: another code), naming the same file, and a leaf where it names one
    (not always the same: the load reads the values first); a deep validation finds it."""
    with pytest.raises(XckptError) as err:
        _convert(src, dst)
    assert err.value.code == code, str(err.value)
    assert not os.path.exists(os.path.join(dst, "xckpt.json"))
    with pytest.raises(XckptError) as again:
        xckpt.load(src)
    if in_place is not None:
        assert again.value.code == in_place, str(again.value)
        return err.value
    assert (again.value.code, again.value.file) == (code, err.value.file), (str(again.value), str(err.value))
    assert (again.value.leaf is None) == (err.value.leaf is None), (str(again.value), str(err.value))
    report = xckpt.validate(src, deep=True)  # the validator reports it, through the same reader
    assert report.format == "dcp" and not report.ok and code in report.codes(), [str(f) for f in report.findings]
    return err.value


def _check_exact(conv: dict) -> None:
    want = _state()
    for name, t in want.items():
        if not isinstance(t, torch.Tensor):
            continue
        got, exp = conv[name], to_host(t)
        assert got.dtype == exp.dtype and got.shape == exp.shape, name
        assert got.tobytes() == np.ascontiguousarray(exp).tobytes(), name  # bit for bit (NaN, -0.0 included)
        if exp.dtype.kind in "biuc" or exp.dtype == np.float32:
            np.testing.assert_array_equal(got, exp)
    assert conv["step"] == 12 and conv["name"] == "hostile-test"
    assert conv["cfg"] == {"lr": 0.5, "betas": (0.9, 0.99), "tags": ["a", "b"]}


def _md(path) -> Metadata:
    """The checkpoint's metadata, read the trusting way (the test wrote it)."""
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)


def _write_md(path, md) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


# -- (a) real checkpoints convert exactly ---------------------------------------------------------


@pytest.mark.parametrize("single_file", [True, False])
def test_real_dcp_converts_exactly(tmp_path, single_file):
    src = tmp_path / "src"
    _save(src, single_file=single_file)
    files = len(list(src.glob("__*.distcp")))
    assert files == 1 if single_file else files > 10
    md = _md(src)
    assert len(md.state_dict_metadata["big"].chunks) == 2
    _convert(src, tmp_path / "out")
    _check_exact(xckpt.load(tmp_path / "out"))


def _whole_loads(monkeypatch) -> list[str]:
    """The fqns of the DCP chunks an in-place load will load whole (``torch.load``) rather than read straight."""
    from xckpt_torch import dcp_source

    loaded: list[str] = []
    whole = dcp_source._read_chunk

    def counted(d, info, fqn, region, dtype):
        loaded.append(fqn)
        return whole(d, info, fqn, region, dtype)
    monkeypatch.setattr(dcp_source, "_read_chunk", counted)
    return loaded


def _rewrite_item(ckpt, fqn: str, change) -> None:
    """Replace the stored item of ``fqn`` by a torch.save archive rebuilt member by member (uncompressed), each
    member's bytes passed through ``change(name, data)``, appended to the data file and retargeted there."""
    import io
    import zipfile

    md = _md(ckpt)
    info = md.storage_data[next(k for k in md.storage_data if k.fqn == fqn)]
    data = ckpt / info.relative_path
    with open(data, "rb") as f:
        f.seek(info.offset)
        item = f.read(info.length)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(item)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for m in src.infolist():
            dst.writestr(m.filename, change(m.filename, src.read(m)))
    with open(data, "ab") as f:
        at = f.tell()
        f.write(out.getvalue())
    _retarget(ckpt, fqn, offset=at, length=len(out.getvalue()))


def test_in_place_loads_read_chunks_straight_into_their_outputs(ckpt, tmp_path, monkeypatch):
    """A DCP chunk that one request wants whole, into C-ordered memory, is read from its archive's data record
    straight into the output, and one wanted in part (or converted) into new memory, then copied (no torch.load); a
    chunk stored in the other byte order or with strides is loaded whole (torch.load) and copied, with the same
    values. (Chunks under STRAIGHT_MIN_BYTES, every one here by default, are loaded whole.)"""
    from xckpt_torch import dcp_source

    loaded = _whole_loads(monkeypatch)
    _check_exact(xckpt.load(ckpt))
    tensors = sorted(k for k, v in _state().items() if isinstance(v, torch.Tensor) and v.numel())
    assert sorted(loaded) == sorted(tensors + ["big"]), loaded  # every chunk ("big" has two) loaded whole
    monkeypatch.setattr(dcp_source, "STRAIGHT_MIN_BYTES", 0)
    loaded.clear()
    back = xckpt.load(ckpt)
    _check_exact(back)
    assert loaded == [], loaded  # every chunk, the two of "big" included, read straight
    _convert(ckpt, tmp_path / "converted")  # a conversion reads each chunk from its record too
    _check_exact(xckpt.load(tmp_path / "converted"))
    assert loaded == [], loaded
    w = torch.empty(BIG_ROWS, 5)
    got = xckpt.load(ckpt, {"big": w, "f32": xckpt.ReadSpec(region=(slice(0, 3), slice(1, 3)))}, strict=False)
    assert got["big"] is w and torch.equal(w, _state()["big"]) and loaded == [], loaded  # f32 read whole, straight
    np.testing.assert_array_equal(got["f32"], _state()["f32"].numpy()[:, 1:3])

    loaded.clear()
    _rewrite_item(ckpt, "f64", lambda name, b: b"big" if name.endswith("/byteorder") else
                  np.frombuffer(b, "<f8").astype(">f8").tobytes() if "/data/" in name else b)
    _rewrite_item(ckpt, "i32", lambda name, b: b)  # rebuilt, still native: read straight from its new place
    np.testing.assert_array_equal(xckpt.load(ckpt)["f64"], _state()["f64"].numpy())  # torch.load swaps it back
    _check_exact(xckpt.load(ckpt))
    assert sorted(set(loaded)) == ["f64"], loaded

    src = tmp_path / "strided"
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # stored with its strides
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"t": t, "c": t.contiguous()}, checkpoint_id=str(src), no_dist=True)
    loaded.clear()
    back = xckpt.load(src)
    np.testing.assert_array_equal(back["t"], t.numpy())
    np.testing.assert_array_equal(back["c"], t.numpy())
    assert loaded == ["t"], loaded


def test_chunks_read_straight_at_once_fail_as_one_when_the_file_is_cut(ckpt, monkeypatch):
    """Chunks read straight into their outputs go a few at once (the checkpoint's own threads); the data file cut
    short under them is chunk.truncated naming the file and a tensor, raised once every read has ended."""
    from xckpt_torch import dcp_source
    from xckpt_torch.dcp_metadata import DcpDirectory

    monkeypatch.setattr(dcp_source, "STRAIGHT_MIN_BYTES", 0)
    opened, calls = DcpDirectory.item, []

    def item_then_cut(self, info):
        f = opened(self, info)
        calls.append(threading.current_thread().name)
        if calls[-1].startswith("xckpt-dcp") and calls.count(calls[-1]) == 2:  # a read straight, on a thread
            os.truncate(self.path(info.relative_path), 100)
        return f
    monkeypatch.setattr(DcpDirectory, "item", item_then_cut)
    with pytest.raises(XckptError) as err:
        xckpt.load(ckpt, {k: v for k, v in _state().items() if isinstance(v, torch.Tensor) and v.numel() > 1},
                   strict=False)
    assert err.value.code == "chunk.truncated" and err.value.file == str(ckpt / "__0_0.distcp"), err.value
    assert err.value.leaf in _state(), err.value


def test_a_deep_validation_loads_each_dcp_chunk_once(tmp_path, monkeypatch):
    """A tensor whose DCP chunks split its columns is read back chunk by chunk, in pieces within each chunk: every
    chunk loaded once, not once per band of rows across them."""
    import importlib

    validate_mod = importlib.import_module("xckpt.validate")  # (xckpt.validate is also the function)
    src = tmp_path / "wide"
    wide = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"wide": wide}, storage_writer=FileSystemWriter(str(src)), planner=_SplitPlanner("wide", 1, 3),
                 no_dist=True)
    assert [tuple(c.offsets) for c in _md(src).state_dict_metadata["wide"].chunks] == [(0, 0), (0, 3)]
    monkeypatch.setattr(validate_mod, "DCP_PIECE_BYTES", 16)  # pieces of 4 elements: a row of a chunk at a time
    loaded = _whole_loads(monkeypatch)
    report = xckpt.validate(src, deep=True)
    assert report.ok and report.bytes_checked == wide.numel() * 4, report
    assert loaded == ["wide", "wide"], loaded
    np.testing.assert_array_equal(xckpt.load(src)["wide"], wide.numpy())


def test_dcp_zstandard_compressed_checkpoint_converts_exactly_and_a_bomb_is_refused(tmp_path):
    """DCP's ZStandard extension (``FileSystemWriter(_extensions=[ZStandard()])``) writes each item as a zstd
    stream: converted exactly; a stream that expands past its chunk's size (a few bytes standing for a GiB) is
    ``resource.too_large`` naming the data file, a corrupt one ``chunk.codec``; other extensions stay refused."""
    from torch.distributed.checkpoint._extension import ZStandard

    import zstandard

    src = tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=FileSystemWriter(str(src), _extensions=[ZStandard()]),
                 planner=_SplitPlanner(), no_dist=True)
    md = _md(src)
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {("stream.zstd/1",)}
    _convert(src, tmp_path / "out")
    _check_exact(xckpt.load(tmp_path / "out"))

    data = src / "__0_0.distcp"
    f32 = md.storage_data[next(k for k in md.storage_data if k.fqn == "f32")]
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 30))  # 1 GiB of zeros in a few dozen KiB
    with open(data, "ab") as f:
        at = f.tell()
        f.write(bomb)
    _retarget(src, "f32", offset=at, length=len(bomb))
    err = _fails(src, tmp_path / "out2", "resource.too_large")
    assert (err.file, err.leaf) == (str(data), "f32"), err
    _retarget(src, "f32", offset=at, length=40)  # the stream cut short
    err = _fails(src, tmp_path / "out3", "chunk.codec")
    assert (err.file, err.leaf) == (str(data), "f32"), err
    _retarget(src, "f32", offset=f32.offset, length=f32.length, transform_descriptors=["stream.zstd/2"])
    _fails(src, tmp_path / "out4", "convert.dcp_transform")


def test_real_metadata_uses_only_admitted_globals(base):
    """Every global in a real ``.metadata`` is admitted, and the restricted load equals pickle's."""
    data = (base / ".metadata").read_bytes()
    seen: list[tuple[str, str]] = []

    class Recorder(dcp_metadata.MetadataUnpickler):
        def find_class(self, module, name):
            seen.append((module, name))
            return super().find_class(module, name)

    import io
    md = Recorder(io.BytesIO(data), file="x").load()
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    assert ("torch", "bfloat16") in seen and ("torch.serialization", "_get_layout") in seen
    assert md == pickle.loads(data)
    assert dcp_metadata.load_metadata(data, file="x") == md


# -- (b) crafted pickles never run code -----------------------------------------------------------


def _s(text: str) -> bytes:
    b = text.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _call(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle calling ``module.name(*args)``."""
    return b"\x80\x04" + _s(module) + _s(name) + b"\x93(" + b"".join(_s(a) for a in args) + b"tR."


def _payloads(marker: str) -> dict[str, tuple[bytes, str]]:
    """Pickles that would create ``marker``, each with the global the refusal must name."""
    touch = f"touch {marker}"
    py = f"open({marker!r}, 'w').close()"
    return {
        "os.system": (_call("os", "system", touch), "os.system"),
        "posix.system": (_call("posix", "system", touch), "posix.system"),
        "eval": (_call("builtins", "eval", py), "builtins.eval"),
        "exec": (_call("builtins", "exec", py), "builtins.exec"),
        "subprocess": (_call("subprocess", "getoutput", touch), "subprocess.getoutput"),
        "dotted": (_call("torch.distributed.checkpoint.metadata", "os.system", touch),
                   "torch.distributed.checkpoint.metadata.os.system"),
        "torch.load": (_call("torch", "load", marker), "torch.load"),
        "getattr": (_call("builtins", "getattr", "x", "y"), "builtins.getattr"),
        "import": (_call("builtins", "__import__", "os"), "builtins.__import__"),
        "protocol2": (b"\x80\x02cos\nsystem\n(" + _s(touch) + b"tR.", "os.system"),
    }


@pytest.mark.parametrize("kind", sorted(_payloads("m")))
def test_crafted_pickle_runs_nothing(ckpt, tmp_path, kind):
    marker = tmp_path / "pwned"
    payload, name = _payloads(str(marker))[kind]
    (ckpt / ".metadata").write_bytes(payload)
    err = _fails(ckpt, tmp_path / "out", "convert.dcp_pickle")
    assert not marker.exists()
    assert err.file == str(ckpt / ".metadata")
    assert name in str(err)


class Metadata_:
    """An object claiming to be DCP's ``Metadata`` whose ``__reduce__`` calls a disallowed function."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


Metadata_.__name__ = Metadata_.__qualname__ = "Metadata"


def test_reduce_with_admitted_name_but_other_callable(ckpt, tmp_path):
    """A real Metadata carrying an object (named like an admitted class) whose reduce calls os.system."""
    marker = tmp_path / "pwned"
    md = _md(ckpt)
    md.planner_data["step"] = Metadata_(str(marker))
    _write_md(ckpt, md)
    err = _fails(ckpt, tmp_path / "out", "convert.dcp_pickle")
    assert "system" in str(err)
    assert not marker.exists()


def test_build_may_not_touch_classes_or_shared_objects(ckpt, tmp_path):
    """BUILD on an admitted class, an enum member or a dtype, or with non-field names, is refused."""
    md_mod = "torch.distributed.checkpoint.metadata"
    before = Metadata.__init__
    on_class = b"\x80\x04" + _s(md_mod) + _s("Metadata") + b"\x93N}" + _s("__init__") + _s("x") + b"s\x86b."
    on_member = (b"\x80\x04" + _s(md_mod) + _s("_MEM_FORMAT_ENCODING") + b"\x93K\x00\x85R}" + _s("_value_")
                 + b"K\x05sb.")
    on_dtype = b"\x80\x04" + _s("torch") + _s("float32") + b"\x93}" + _s("x") + b"K\x01sb."
    extra = b"\x80\x04" + _s(md_mod) + _s("StorageMeta") + b"\x93)\x81}" + _s("__setstate__") + b"K\x01sb."
    for payload in (on_class, on_member, on_dtype, extra):
        (ckpt / ".metadata").write_bytes(payload)
        _fails(ckpt, tmp_path / "out", "convert.dcp_pickle")
    assert Metadata.__init__ is before
    assert _MEM_FORMAT_ENCODING(0).value == 0 and not hasattr(torch.float32, "x")


def test_refused_opcodes_and_calls(ckpt, tmp_path):
    persistent = b"\x80\x04" + _s("x") + b"Q."
    extension = b"\x80\x04\x82\x01."
    inst = b"(ios\nsystem\nS'true'\n."
    call_dtype = b"\x80\x04" + _s("torch") + _s("float32") + b"\x93)R."
    bad_layout = _call("torch.serialization", "_get_layout", "torch.load")
    bad_path = b"\x80\x04" + _s("pathlib") + _s("PosixPath") + b"\x93K\x01\x85R."
    for payload in (persistent, extension, inst, call_dtype, bad_layout, bad_path):
        (ckpt / ".metadata").write_bytes(payload)
        _fails(ckpt, tmp_path / "out", "convert.dcp_pickle")


def test_value_payload_is_loaded_weights_only(ckpt, tmp_path):
    """A stored value whose torch.save pickle would run code: torch's weights_only load refuses it."""
    import io
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(Metadata_(str(marker)), buf)
    extra = ckpt / "__9_0.distcp"
    extra.write_bytes(buf.getvalue())
    md = _md(ckpt)
    md.storage_data[MetadataIndex("step")] = _StorageInfo(extra.name, 0, len(buf.getvalue()))
    _write_md(ckpt, md)
    _fails(ckpt, tmp_path / "out", "convert.dcp_value")
    assert not marker.exists()


# -- (c) the pickle must hold valid Metadata -------------------------------------------------------


@pytest.mark.parametrize("obj", [{"state_dict_metadata": {}}, 42, None, StorageMeta(), torch.Size([1])])
def test_not_metadata(ckpt, tmp_path, obj):
    (ckpt / ".metadata").write_bytes(pickle.dumps(obj))
    err = _fails(ckpt, tmp_path / "out", "convert.dcp_metadata")
    assert err.file == str(ckpt / ".metadata")


def _shared_tuple_key(levels: int) -> bytes:
    """A pickle of ``{T: 1}`` where ``T`` is a tuple of two references to a tuple of two references ... ``levels``
    deep (through the memo): about 10 bytes a level, 2**levels steps to hash."""
    level = b"r\x00\x00\x00\x00" + b"0" + b"j\x00\x00\x00\x00" * 2 + b"\x86"  # memo[0] = T; pop; (T, T)
    return b"\x80\x02}" + b")" + level * levels + b"K\x01s."


@pytest.mark.timeout(120)
def test_structures_costly_to_hash_or_to_walk_are_refused_at_once(ckpt, tmp_path):
    """A 1 KB pickle whose dict key takes 2**60 steps to hash, a huge int as a key (hashed again at every use), a
    MetadataIndex whose offset is not a short tuple of integers; tensor properties that are not a layout and two
    flags (ranks' files compare them: a deep list took the recursion limit); a flattening path longer than a
    tree is deep (walked recursively):
    each refused at once (``convert.dcp_metadata``), by conversion, load and validation alike."""
    good = (ckpt / ".metadata").read_bytes()
    assert pickle.loads(_shared_tuple_key(2)) == {(((), ()), ((), ())): 1}  # the pickle is what it says
    for blob in (_shared_tuple_key(60), pickle.dumps({10 ** 5000: 1})):
        (ckpt / ".metadata").write_bytes(blob)
        assert "dict key" in str(_fails(ckpt, tmp_path / "out", "convert.dcp_metadata"))
    (ckpt / ".metadata").write_bytes(good)
    md = _md(ckpt)
    index = next(i for i in md.storage_data if i.offset is not None)
    info = md.storage_data.pop(index)
    object.__setattr__(index, "offset", ((0, 0), (0, 0)))
    md.storage_data[index] = info
    _write_md(ckpt, md)
    assert "dict key" in str(_fails(ckpt, tmp_path / "out", "convert.dcp_metadata"))
    for field, value in (("layout", [[["deep"]]]), ("requires_grad", 1), ("pin_memory", None)):
        md = pickle.loads(good)
        setattr(md.state_dict_metadata["f32"].properties, field, value)
        _write_md(ckpt, md)
        err = _fails(ckpt, tmp_path / "out", "convert.dcp_metadata")
        assert err.leaf == "f32" and "properties" in str(err), str(err)
    for parts, ok in ((64, True), (65, False), (20000, False)):
        md = pickle.loads(good)
        md.planner_data = {**(md.planner_data or {}), "step": ("s",) * parts}
        _write_md(ckpt, md)
        if ok:  # as deep as a tree may be: converted (the path names the value's place)
            _convert(ckpt, tmp_path / "deep")
            got = xckpt.load(tmp_path / "deep")
            for _ in range(parts):
                got = got["s"]
            assert got == 12
            shutil.rmtree(tmp_path / "deep")
            continue
        err = _fails(ckpt, tmp_path / "out", "convert.dcp_metadata")
        assert err.leaf == "step" and "more than 64" in str(err), str(err)


def test_inconsistent_or_broken_metadata(ckpt, tmp_path):
    good = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(good[: len(good) // 2])
    _fails(ckpt, tmp_path / "out", "convert.dcp_metadata")
    md = pickle.loads(good)
    md.state_dict_metadata["big"].chunks[1].sizes = torch.Size([BIG_ROWS, 5])  # beyond the tensor
    _write_md(ckpt, md)
    _fails(ckpt, tmp_path / "out", "convert.dcp_metadata")
    md = pickle.loads(good)
    md.state_dict_metadata["f32"].size = "3"
    _write_md(ckpt, md)
    _fails(ckpt, tmp_path / "out", "convert.dcp_metadata")
    md = pickle.loads(good)
    del md.storage_data[MetadataIndex("step")]
    _write_md(ckpt, md)
    _fails(ckpt, tmp_path / "out", "convert.dcp_metadata")
    (ckpt / ".metadata").write_bytes(pickle.dumps(Metadata.__new__(Metadata)))  # no fields at all
    _fails(ckpt, tmp_path / "out", "convert.dcp_metadata")


def test_per_rank_metadata_of_a_save_without_collectives(tmp_path):
    """A DCP save without collectives leaves one ``__<rank>.metadata`` per rank and no ``.metadata``: they are
    merged (the chunks of a tensor split between ranks joined, a replica counted once); a rank missing, or
    ranks that disagree about a tensor, are refused naming the file."""
    src = tmp_path / "ranks"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(_state(), storage_writer=FileSystemWriter(str(src)), planner=_SplitPlanner(), no_dist=True,
                 use_collectives=False)
    assert not (src / ".metadata").exists() and (src / "__0.metadata").exists()
    _convert(src, tmp_path / "one")
    _check_exact(xckpt.load(tmp_path / "one"))
    # as two ranks would have written it: rank 1 holds the second chunk of "big" and a replica of "step", in a
    # data file of its own; rank 0 everything else
    rank0 = pickle.loads((src / "__0.metadata").read_bytes())
    rank1 = pickle.loads((src / "__0.metadata").read_bytes())
    second = rank0.state_dict_metadata["big"].chunks.pop(1)
    rank1.state_dict_metadata = {"big": dataclasses.replace(rank1.state_dict_metadata["big"], chunks=[second]),
                                 "step": rank1.state_dict_metadata["step"]}
    shutil.copyfile(src / "__0_0.distcp", src / "__1_0.distcp")
    rank1.storage_data = {i: dataclasses.replace(info, relative_path="__1_0.distcp")
                          for i, info in rank1.storage_data.items() if i.fqn in rank1.state_dict_metadata}
    del rank0.storage_data[MetadataIndex("big", second.offsets)]
    (src / "__0.metadata").write_bytes(pickle.dumps(rank0))
    (src / "__1.metadata").write_bytes(pickle.dumps(rank1))
    _convert(src, tmp_path / "two")
    _check_exact(xckpt.load(tmp_path / "two"))
    (src / "__1.metadata").rename(src / "__2.metadata")  # rank 1's file is missing
    assert _fails(src, tmp_path / "out", "convert.dcp_metadata").file == str(src / "__1.metadata")
    (src / "__2.metadata").unlink()
    assert _fails(src, tmp_path / "out", "shape.tiling").leaf == "big"  # rank 0 alone lacks a chunk of "big"
    for change in ({"size": torch.Size([BIG_ROWS + 1, *rank1.state_dict_metadata["big"].size[1:]])},
                   {"chunks": [dataclasses.replace(second, sizes=torch.Size([1, *second.sizes[1:]]))]}):
        bad = pickle.loads(pickle.dumps(rank1))
        item = bad.state_dict_metadata["big"]
        if "chunks" in change:  # the same offsets as a chunk rank 0 also describes, another size
            rank0_too = pickle.loads(pickle.dumps(rank0))
            rank0_too.state_dict_metadata["big"].chunks.append(second)
            rank0_too.storage_data[MetadataIndex("big", second.offsets)] = rank1.storage_data[
                MetadataIndex("big", second.offsets)]
            (src / "__0.metadata").write_bytes(pickle.dumps(rank0_too))
        bad.state_dict_metadata["big"] = dataclasses.replace(item, **change)
        (src / "__1.metadata").write_bytes(pickle.dumps(bad))
        err = _fails(src, tmp_path / "out", "convert.dcp_metadata")
        assert err.file == str(src / "__1.metadata") and "big" in str(err)
        (src / "__0.metadata").write_bytes(pickle.dumps(rank0))


def test_oversized_metadata(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(dcp_metadata, "MAX_METADATA_BYTES", (ckpt / ".metadata").stat().st_size - 1)
    _fails(ckpt, tmp_path / "out", "resource.too_large")
    monkeypatch.undo()
    _convert(ckpt, tmp_path / "out")


# -- (d), (e) links and special files --------------------------------------------------------------


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_symlink_refused_and_target_unread(ckpt, tmp_path, name):
    probe(tmp_path)  # the watch sees reads here
    outside = tmp_path / f"outside{name}"
    shutil.copyfile(ckpt / name, outside)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(outside)
    with Opened(outside) as seen:
        err = _fails(ckpt, tmp_path / "out", "path.link")
        assert seen.paths() == [], "the link's target was read"
    assert err.file == str(ckpt / name)


def test_fifo_refused_without_blocking(ckpt, tmp_path):
    data = ckpt / "__0_0.distcp"
    data.unlink()
    os.mkfifo(data)
    result: list[BaseException | None] = []

    def run():
        try:
            _convert(ckpt, tmp_path / "out")
            result.append(None)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=20)
    if t.is_alive():  # unblock a reader stuck in open() so the process can finish
        fd = os.open(data, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("conversion blocked on a FIFO")
    assert isinstance(result[0], XckptError) and result[0].code == "path.special", result
    assert not (tmp_path / "out" / "xckpt.json").exists()


def test_directory_in_place_of_data_file(ckpt, tmp_path):
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").mkdir()
    _fails(ckpt, tmp_path / "out", "path.special")


# -- (f) storage entries out of range or escaping ---------------------------------------------------


def _retarget(ckpt, fqn: str, **changes) -> None:
    md = _md(ckpt)
    key = next(k for k in md.storage_data if k.fqn == fqn)
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], **changes)
    _write_md(ckpt, md)


def test_range_beyond_file(ckpt, tmp_path):
    size = (ckpt / "__0_0.distcp").stat().st_size
    _retarget(ckpt, "f32", offset=size - 10)
    err = _fails(ckpt, tmp_path / "out", "chunk.truncated")
    assert err.file == str(ckpt / "__0_0.distcp")
    _retarget(ckpt, "f32", offset=0, length=size + 1)
    _fails(ckpt, tmp_path / "out", "chunk.truncated")
    _retarget(ckpt, "f32", offset=-1, length=10)
    _fails(ckpt, tmp_path / "out", "convert.dcp_metadata")


def test_file_cut_short_while_converting(ckpt, tmp_path, monkeypatch):
    """The data file shrinks after its ranges were checked (another process truncating it): the item, read
    on demand straight into its tensor, gives chunk.truncated naming the file, not torch's own error."""
    from xckpt_torch.dcp_metadata import DcpDirectory

    opened = DcpDirectory.item

    def item_then_cut(self, info):
        f = opened(self, info)
        os.truncate(self.path(info.relative_path), info.offset + info.length // 2)
        return f
    monkeypatch.setattr(DcpDirectory, "item", item_then_cut)
    err = _fails(ckpt, tmp_path / "out", "chunk.truncated")
    assert err.file == str(ckpt / "__0_0.distcp"), err


@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/passwd", "sub/__0_0.distcp", "..", ""])
def test_escaping_relative_path(ckpt, tmp_path, rel):
    probe(tmp_path)  # the watch sees reads here
    outside = tmp_path / "outside.distcp"
    shutil.copyfile(ckpt / "__0_0.distcp", outside)
    _retarget(ckpt, "f32", relative_path=rel)
    with Opened(outside) as seen:
        _fails(ckpt, tmp_path / "out", "path.unsafe")
        assert seen.paths() == []


def test_missing_data_file_and_transforms(ckpt, tmp_path):
    _retarget(ckpt, "f32", relative_path="__7_7.distcp")
    _fails(ckpt, tmp_path / "out", "chunk.missing")
    _retarget(ckpt, "f32", relative_path="__0_0.distcp", transform_descriptors=["zstd"])
    _fails(ckpt, tmp_path / "out", "convert.dcp_transform")


def test_an_archive_zipfile_cannot_read_is_refused(ckpt, tmp_path):
    """A stored item whose zip directory asks for a zip version Python's zipfile does not implement (its
    NotImplementedError, found by fuzzing) is convert.dcp_chunk naming the data file, like any unreadable one."""
    md = _md(ckpt)
    info = md.storage_data[next(k for k in md.storage_data if k.fqn == "f32")]
    data = ckpt / info.relative_path
    raw = bytearray(data.read_bytes())
    central = raw.index(b"PK\x01\x02", info.offset, info.offset + info.length)
    raw[central + 6] = 217  # "version needed to extract": 21.7
    data.write_bytes(bytes(raw))
    err = _fails(ckpt, tmp_path / "out", "convert.dcp_chunk")
    assert (err.file, err.leaf) == (str(data), "f32") and "NotImplementedError" in err.message, err


def test_chunk_that_is_not_its_recorded_tensor(ckpt, tmp_path):
    """A storage entry pointing at another tensor's bytes: caught after the load, nothing committed."""
    md = _md(ckpt)
    f64 = md.storage_data[next(k for k in md.storage_data if k.fqn == "f64")]
    _retarget(ckpt, "f32", offset=f64.offset, length=f64.length)
    _fails(ckpt, tmp_path / "out", "convert.dcp_chunk")


# -- (g) the root may be reached through links ------------------------------------------------------


def test_root_through_symlinks(ckpt, tmp_path):
    alias = tmp_path / "alias"
    alias.symlink_to(ckpt, target_is_directory=True)
    _convert(alias, tmp_path / "out1")
    _check_exact(xckpt.load(tmp_path / "out1"))
    parent = tmp_path / "parent"
    parent.symlink_to(ckpt.parent, target_is_directory=True)
    _convert(parent / ckpt.name, tmp_path / "out2")
    _check_exact(xckpt.load(tmp_path / "out2"))


def test_not_a_dcp_checkpoint(tmp_path):
    _fails(tmp_path / "nothing", tmp_path / "out", "convert.not_dcp", in_place="manifest.missing")
    (tmp_path / "empty").mkdir()
    _fails(tmp_path / "empty", tmp_path / "out", "convert.not_dcp", in_place="manifest.missing")


def test_two_names_of_one_key_are_refused(ckpt, tmp_path):
    """Metadata whose flattening paths give two tensors one key would lose one: refused, naming it and the
    checkpoint's .metadata."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    names = [n for n in md.state_dict_metadata if n != "f32"]
    md.planner_data = dict(md.planner_data or {})
    md.planner_data[names[0]] = ("f32",)
    _write_md(ckpt, md)
    err = _fails(ckpt, tmp_path / "out", "tree.invalid")
    assert err.leaf == "f32" and "two entries" in str(err) and err.file == str(ckpt / ".metadata")


# -- (h) what real DCP saves beyond plain tensors and values; absurd metadata named precisely ---------------


def test_bytesio_values_convert_as_their_bytes(tmp_path):
    """DCP stores an ``io.BytesIO`` leaf (BytesStorageMetadata) as a pickled file object; converting gives its
    bytes, alone and inside a list DCP pickles whole, next to tensors compared element by element."""
    import io
    src = tmp_path / "src"
    state = {"blob": io.BytesIO(b"\x00loader-state\xff"), "blobs": [io.BytesIO(b"a"), io.BytesIO(b"")],
             "w": torch.arange(6, dtype=torch.int16).reshape(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(src)), no_dist=True)
    _convert(src, tmp_path / "out")
    got = xckpt.load(tmp_path / "out")
    assert got["blob"] == b"\x00loader-state\xff" and got["blobs"] == [b"a", b""]
    np.testing.assert_array_equal(got["w"], state["w"].numpy())


class _HugeBytes:
    """Pickles as ``bytes(2**40)``: admitting ``bytes`` for an empty BytesIO must not admit this."""

    def __reduce__(self):
        return (bytes, (2 ** 40,))


def test_value_calling_bytes_with_a_size_is_refused(ckpt, tmp_path):
    import io
    buf = io.BytesIO()
    torch.save([io.BytesIO(b"x"), _HugeBytes()], buf)
    (ckpt / "__9_0.distcp").write_bytes(buf.getvalue())
    md = _md(ckpt)
    md.storage_data[MetadataIndex("step")] = _StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))
    _write_md(ckpt, md)
    err = _fails(ckpt, tmp_path / "out", "convert.dcp_value")
    assert (err.file, err.leaf) == (str(ckpt / "__9_0.distcp"), "step"), err


def _one_tensor_md(ckpt, size, chunks) -> None:
    """Rewrite the checkpoint's ``f32`` as a tensor of ``size`` stored as ``chunks`` ((offsets, sizes) each, all
    pointing at f32's real bytes)."""
    md = _md(ckpt)
    info = md.storage_data.pop(MetadataIndex("f32", torch.Size([0, 0])))
    old = md.state_dict_metadata["f32"]
    md.state_dict_metadata["f32"] = dataclasses.replace(
        old, size=torch.Size(size), chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    for o, _ in chunks:
        md.storage_data[MetadataIndex("f32", torch.Size(o))] = info
    _write_md(ckpt, md)


@pytest.mark.parametrize("size, chunks, code", [
    ([2 ** 40, 2 ** 40], [([0, 0], [2 ** 40, 2 ** 40])], "shape.too_large"),  # more elements than the format has
    ([2 ** 100, 4], [([0, 0], [2 ** 100, 4])], "shape.too_large"),  # beyond msgpack's integers
    ([1] * 65, [([0] * 65, [1] * 65)], "convert.dcp_metadata"),  # more dimensions than an array can have
    ([3, 4], [([0, 0], [3, 4])] * 1000, "convert.dcp_metadata"),  # one chunk listed again and again
])
def test_absurd_tensor_metadata_is_refused_naming_file_and_leaf(ckpt, tmp_path, size, chunks, code):
    """Sizes no array can have, and repeated chunks, are refused while the metadata is checked, with the
    .metadata file and the tensor named: never a bare msgpack or numpy error, never converted."""
    _one_tensor_md(ckpt, size, chunks)
    err = _fails(ckpt, tmp_path / "out", code)
    assert (err.file, err.leaf) == (str(ckpt / ".metadata"), "f32"), err


def test_errors_about_one_entry_name_it(ckpt, tmp_path):
    """A stored range beyond its file or a missing data file names the entry as well as the file; a tensor of a
    dtype xckpt lacks (complex32, which real DCP saves) names the tensor and the metadata file."""
    size = (ckpt / "__0_0.distcp").stat().st_size
    _retarget(ckpt, "f64", offset=size - 10)
    err = _fails(ckpt, tmp_path / "out", "chunk.truncated")
    assert (err.file, err.leaf) == (str(ckpt / "__0_0.distcp"), "f64"), err
    _retarget(ckpt, "f64", relative_path="__7_7.distcp")
    err = _fails(ckpt, tmp_path / "out", "chunk.missing")
    assert (err.file, err.leaf) == (str(ckpt / "__7_7.distcp"), "f64"), err
    src = tmp_path / "c32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"ok": torch.ones(2), "half_complex": torch.zeros(3, dtype=torch.complex32)},
                 storage_writer=FileSystemWriter(str(src)), no_dist=True)
    err = _fails(src, tmp_path / "out", "dtype.unsupported")
    assert (err.file, err.leaf) == (str(src / ".metadata"), "half_complex"), err


# -- (i) numpy data inside DCP values: parsed, never run ------------------------------------------


def _numpy_state() -> dict:
    """numpy data as training code hands it to DCP, which pickles each non-tensor value whole."""
    rs = np.random.RandomState(11)
    return {
        "np_rng": rs.get_state(),  # ('MT19937', uint32[624], pos, has_gauss, cached)
        "arrays": {code: (np.arange(-3, 3) * 7).astype(code) for code in
                   ("?", "i1", "i2", "<i4", "<i8", "u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16")},
        "big_endian": np.linspace(-1, 1, 6, dtype=">f8").reshape(2, 3),
        "fortran": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
        "empty": np.zeros((0, 5), dtype=np.float32),
        "scalars": [np.float32(1.5), np.int64(-2 ** 40), np.bool_(True), np.float64("nan")],
        "mixed": (torch.arange(3, dtype=torch.int16), np.uint8(7), "tag"),
    }


def test_numpy_values_convert_exactly(tmp_path):
    """A real DCP checkpoint whose values hold numpy arrays, scalars (0-d arrays after, as ``xckpt.save`` stores
    them) and an RNG state converts element by element, dtypes included; the RNG state restored from the
    xckpt checkpoint draws what the original does."""
    src = tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**_numpy_state(), "w": torch.ones(2, 3)}, storage_writer=FileSystemWriter(str(src)), no_dist=True)
    _convert(src, tmp_path / "out")
    got, want = xckpt.load(tmp_path / "out"), _numpy_state()
    for code, arr in want["arrays"].items():
        assert got["arrays"][code].dtype == arr.dtype.newbyteorder("<"), code
        np.testing.assert_array_equal(got["arrays"][code], arr)
    for name in ("big_endian", "fortran", "empty"):
        assert got[name].dtype == want[name].dtype.newbyteorder("<") and got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name])
    for g, w in zip(got["scalars"], want["scalars"]):
        assert isinstance(g, np.ndarray) and g.shape == () and g.dtype == w.dtype
        assert g.tobytes() == np.asarray(w).tobytes()
    assert got["mixed"][1].dtype == np.uint8 and got["mixed"][1] == 7 and got["mixed"][2] == "tag"
    np.testing.assert_array_equal(got["mixed"][0], np.arange(3, dtype=np.int16))
    name, key, pos, has_gauss, cached = got["np_rng"]
    w_name, w_key, w_pos, w_has_gauss, w_cached = want["np_rng"]
    assert (name, pos, has_gauss, cached) == (w_name, w_pos, w_has_gauss, w_cached)
    assert key.dtype == np.uint32 and key.shape == (624,)
    np.testing.assert_array_equal(key, w_key)
    restored, original = np.random.RandomState(), np.random.RandomState(11)
    restored.set_state(got["np_rng"])
    np.testing.assert_array_equal(restored.randint(0, 2 ** 31, size=100), original.randint(0, 2 ** 31, size=100))

    # and back to DCP: stock DCP loads numpy data as numpy again (a scalar as a scalar), tensors as tensors
    convert(str(tmp_path / "out"), str(tmp_path / "back"), target="dcp")
    again = {"np_rng": None, "arrays": dict.fromkeys(want["arrays"]), "big_endian": None, "fortran": None,
             "empty": None, "scalars": None, "mixed": None, "w": torch.zeros(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(again, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    assert again["np_rng"][0] == "MT19937" and again["np_rng"][2:] == want["np_rng"][2:]
    assert type(again["np_rng"][1]) is np.ndarray and again["np_rng"][1].dtype == np.uint32
    np.testing.assert_array_equal(again["np_rng"][1], want["np_rng"][1])
    for code, arr in want["arrays"].items():
        assert type(again["arrays"][code]) is np.ndarray and again["arrays"][code].dtype == arr.dtype.newbyteorder("<")
        np.testing.assert_array_equal(again["arrays"][code], arr)
    for name in ("big_endian", "fortran", "empty"):
        assert type(again[name]) is np.ndarray and again[name].shape == want[name].shape, name
        np.testing.assert_array_equal(again[name], want[name])
    for g, w in zip(again["scalars"], want["scalars"]):
        assert type(g) is type(w) and np.asarray(g).tobytes() == np.asarray(w).tobytes()
    assert isinstance(again["mixed"][0], torch.Tensor) and type(again["mixed"][1]) is np.uint8
    assert torch.equal(again["mixed"][0], want["mixed"][0]) and again["mixed"][1:] == (7, "tag")


def _value_blob(obj, rewrite=None) -> bytes:
    """``torch.save(obj)``, its pickle passed through ``rewrite`` (the archive rebuilt around it)."""
    import io
    import zipfile
    buf = io.BytesIO()
    torch.save(obj, buf)
    if rewrite is None:
        return buf.getvalue()
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
        for info in z.infolist():
            data = z.read(info.filename)
            w.writestr(info.filename, rewrite(data) if info.filename.endswith("/data.pkl") else data)
    return out.getvalue()


def _as_step_value(ckpt, blob: bytes) -> None:
    """Make ``blob`` (torch.save bytes) the stored value of the checkpoint's ``step``."""
    (ckpt / "__9_0.distcp").write_bytes(blob)
    md = _md(ckpt)
    md.storage_data[MetadataIndex("step")] = _StorageInfo("__9_0.distcp", 0, len(blob))
    _write_md(ckpt, md)


def test_numpy_1x_pickles_convert(ckpt, tmp_path):
    """numpy 1.x pickled its arrays and scalars under ``numpy.core.multiarray``; they convert the same."""
    value = {"key": np.arange(5, dtype=np.uint32) * 3, "lr": np.float64(0.25)}

    def as_numpy_1(data: bytes) -> bytes:
        assert data.count(b"numpy._core.multiarray\n") == 2  # _reconstruct and scalar, numpy 2's names
        return data.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")

    _as_step_value(ckpt, _value_blob(value, as_numpy_1))
    _convert(ckpt, tmp_path / "out")
    got = xckpt.load(tmp_path / "out")["step"]
    assert got["key"].dtype == np.uint32 and got["lr"].dtype == np.float64 and got["lr"] == 0.25
    np.testing.assert_array_equal(got["key"], value["key"])


class _Crafted:
    """Pickles as numpy's own call ``func(*args)`` followed by ``BUILD`` with ``state`` (None: no BUILD)."""

    def __init__(self, func, args, state=None):
        self.reduced = (func, args) if state is None else (func, args, state)

    def __reduce__(self):
        return self.reduced


_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy._core.multiarray._reconstruct
_SCALAR = np.float32(1).__reduce__()[0]  # numpy._core.multiarray.scalar


@pytest.mark.parametrize("value", [
    pytest.param(np.array([1, "a"], dtype=object), id="object-array"),
    pytest.param(np.zeros(2, dtype=[("a", "<f4")]), id="structured"),
    pytest.param(np.array(["ab"]), id="unicode"),
    pytest.param(np.array(["2020-01-01"], dtype="M8[D]"), id="datetime"),
    pytest.param(_Crafted(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (3,), np.dtype("f4"), False, b"\0" * 4)),
                 id="fewer-bytes-than-shape"),
    pytest.param(_Crafted(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (2 ** 40,), np.dtype("f4"), False, b"")),
                 id="huge-shape-no-data"),
    pytest.param(_Crafted(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (-1,), np.dtype("f4"), False, b"")),
                 id="negative-dimension"),
    pytest.param(_Crafted(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (1,), np.dtype("f4"), False, [1.0])),
                 id="data-not-bytes"),
    pytest.param(_Crafted(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (1,), "f4", False, b"\0" * 4)),
                 id="dtype-not-a-dtype"),
    pytest.param(_Crafted(_RECONSTRUCT, (np.ndarray, (0,), b"b")), id="array-never-given-data"),
    pytest.param(_Crafted(_RECONSTRUCT, (np.ndarray, (4,), b"b"), (1, (1,), np.dtype("f4"), False, b"\0" * 4)),
                 id="reconstruct-other-arguments"),
    pytest.param(_Crafted(_SCALAR, (np.dtype("f4"), b"\0\0")), id="scalar-short"),
    pytest.param(_Crafted(_SCALAR, (np.dtype("O"), b"\0" * 8)), id="scalar-object"),
])
def test_numpy_values_not_built_by_numpy_are_refused(ckpt, tmp_path, value):
    """numpy data a plain numeric array could not have written, or that asks for more than its bytes hold, is
    ``convert.dcp_value`` naming the data file and the leaf: numpy's rebuild functions are never called."""
    _as_step_value(ckpt, _value_blob([value]))
    err = _fails(ckpt, tmp_path / "out", "convert.dcp_value")
    assert (err.file, err.leaf) == (str(ckpt / "__9_0.distcp"), "step"), err
    assert "xckpt does not rebuild" in err.message, err  # refused by xckpt's parsers, not by torch's unpickler


def test_a_numpy_dtype_value_is_refused_naming_its_leaf_and_file(tmp_path):
    """A numpy dtype DCP pickled as a value (parsed, never built by numpy) has no xckpt value type: opening the
    checkpoint (a load, a conversion) is value.unsupported naming the leaf and the metadata file, not the
    parser's internal class."""
    src = tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"t": torch.ones(3), "dt": np.dtype("int16")}, storage_writer=FileSystemWriter(str(src)), no_dist=True)
    err = _fails(src, tmp_path / "out", "value.unsupported")
    assert (err.file, err.leaf) == (str(src / ".metadata"), "dt") and "numpy dtype (int16)" in err.message, err


def test_a_refused_numpy_state_is_described_briefly(ckpt, tmp_path):
    """A crafted array state holding 8 MiB of bytes where numpy's holds five fields is refused with a message of a
    under a thousand characters (its description is bounded before it is built, not cut from a repr of it all)."""
    state = (1, b"\0" * (8 << 20), {"k": b"\1" * (8 << 20)}, [b"\2" * (8 << 20)] * 10)
    _as_step_value(ckpt, _value_blob([_Crafted(_RECONSTRUCT, (np.ndarray, (0,), b"b"), state)]))
    err = _fails(ckpt, tmp_path / "out", "convert.dcp_value")
    assert "array state (1, b'\\x00" in err.message and len(err.message) < 1000, err.message[:2000]


# -- (z) shared structures, amplification and huge numbers: refused at once, in bounded memory -------------


class _Slow(Exception):
    """A read that took longer than a refusal takes."""


def _soon(seconds: int, fn):
    """``fn()``, or ``_Slow`` after ``seconds`` (a crafted file that makes the reader hang fails the test at once)."""
    import signal

    def alarm(*_):
        raise _Slow(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _refused_soon(src, code: str, leaf: str | None = None) -> XckptError:
    """Loading, inspecting and converting ``src`` each fail with ``code`` within seconds (naming ``leaf``)."""
    for fn in (lambda: xckpt.load(src), lambda: xckpt.inspect(src), lambda: _convert(src, f"{src}.out")):
        with pytest.raises(XckptError) as err:
            _soon(60, fn)
        assert err.value.code == code and err.value.leaf == leaf, str(err.value)
        assert not os.path.exists(f"{src}.out/xckpt.json")
    return err.value


def _storage(md, fqn: str):
    return next((k, v) for k, v in md.storage_data.items() if k.fqn == fqn)


def _tuple_dag(depth: int, leaf=1):
    t = (leaf,)
    for _ in range(depth):
        t = (t, t)
    return t


def test_shared_tuples_in_metadata_messages_are_never_expanded(ckpt):
    """A ``transform_descriptors`` of 40 levels of shared tuples (1.4 KB of pickle) is refused at once: the message
    describes it without ``repr`` (which took 2**40 steps: every reader hung)."""
    md = _md(ckpt)
    k, v = _storage(md, "f32")
    md.storage_data[k] = dataclasses.replace(v, transform_descriptors=_tuple_dag(40, "x"))
    _write_md(ckpt, md)
    assert "a builtins.tuple object" in str(_refused_soon(ckpt, "convert.dcp_transform", "f32"))


def test_a_metadata_index_filled_twice_or_with_shared_tuples_is_refused(ckpt):
    """A ``MetadataIndex`` given its state a second time (after it was checked as a dict key) with an offset of 40
    levels of shared tuples: refused (it was hashed and printed, 2**40 steps); so is one whose first state holds
    such a field (its ``index``, which is printed though not hashed)."""
    import pickletools
    import struct

    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = _md(ckpt)
    blob = pickle.dumps(md, protocol=2)
    ops = list(pickletools.genops(blob))
    at = next(i for i, (op, arg, _) in enumerate(ops)
              if op.name == "GLOBAL" and arg == "torch.distributed.checkpoint.metadata MetadataIndex")
    new = next(j for j in range(at, len(ops)) if ops[j][0].name == "NEWOBJ")
    memo = ops[new + 1][1]  # the PUT after it
    dag = b"K\x01\x85" + b"2\x86" * 40  # (1,), then 40 times (t, t) by DUP
    again = b"j" + struct.pack("<I", memo) + b"}" + b"X" + struct.pack("<I", 6) + b"offset" + dag + b"sb0"
    (ckpt / ".metadata").write_bytes(blob[:-1] + again + b".")
    assert "once" in str(_refused_soon(ckpt, "convert.dcp_pickle"))
    k, v = _storage(md, "f32")
    del md.storage_data[k]
    key = MetadataIndex("f32", k.offset)
    object.__setattr__(key, "index", _tuple_dag(40))  # (not part of its hash)
    md.storage_data[key] = v
    _write_md(ckpt, md)
    _refused_soon(ckpt, "convert.dcp_metadata", "f32")


@pytest.mark.parametrize("craft", ["ordered_dict_items", "shared_size", "shared_path", "bytearray8"])
def test_calls_that_would_hash_or_copy_without_bound_are_refused(ckpt, craft):
    """What the admitted reconstructions would hash unchecked or copy again at every call is refused: an
    ``OrderedDict`` made from items (its keys: 40 levels of shared tuples, 2**40 steps to hash), 300 ``torch.Size``
    or paths made from one shared list of 100,000 items (each call copied it: 300 calls in a 100 KB pickle took
    2.6 GB), and protocol 5's ``BYTEARRAY8`` (its stated 2 GiB were allocated before anything was read)."""
    import collections
    import pathlib
    import struct

    shared = [1] * 100_000

    class Call:
        def __init__(self, fn, args) -> None:
            self.fn, self.args = fn, args

        def __reduce__(self):
            return self.fn, self.args
    if craft == "bytearray8":
        blob = b"\x80\x05\x96" + struct.pack("<Q", 2 << 30) + b"x."
    elif craft == "ordered_dict_items":
        blob = pickle.dumps(Call(collections.OrderedDict, ([(_tuple_dag(40), 1)],)), protocol=2)
    elif craft == "shared_size":
        blob = pickle.dumps([Call(torch.Size, (shared,)) for _ in range(300)], protocol=2)
    else:
        parts = tuple(["p"] * 100_000)
        blob = pickle.dumps([Call(pathlib.PurePosixPath, parts) for _ in range(300)], protocol=2)
    assert len(blob) < 1 << 20
    (ckpt / ".metadata").write_bytes(blob)
    _refused_soon(ckpt, "convert.dcp_pickle")


def test_an_offset_beyond_64_bits_is_refused_as_metadata(ckpt):
    """A storage offset of 5,000 digits is invalid metadata (it passed, then building the truncation message raised a
    bare ValueError: an int too large to print)."""
    md = _md(ckpt)
    k, v = _storage(md, "f32")
    md.storage_data[k] = dataclasses.replace(v, offset=10 ** 5000)
    _write_md(ckpt, md)
    _refused_soon(ckpt, "convert.dcp_metadata", "f32")


def test_a_gap_of_a_billion_rank_metadata_files_is_named_at_once(tmp_path):
    """``__0.metadata`` and ``__999999999.metadata``: the first missing ranks are named without listing a billion
    of them (that took 100 GB)."""
    (tmp_path / "__0.metadata").write_bytes(b"")
    (tmp_path / "__999999999.metadata").write_bytes(b"")
    err = _refused_soon(tmp_path, "convert.dcp_metadata")
    assert "[1, 2, 3, 4, 5, 6, 7, 8]" in str(err) and err.file.endswith("__1.metadata"), str(err)


def _value_file(ckpt, fqn: str, value_blob: bytes) -> None:
    """Store ``value_blob`` (torch.save bytes) as the value ``fqn`` of the checkpoint, in a file of its own."""
    (ckpt / "v.distcp").write_bytes(value_blob)
    md = _md(ckpt)
    k, v = _storage(md, fqn)
    md.storage_data[k] = dataclasses.replace(v, relative_path="v.distcp", offset=0, length=len(value_blob))
    _write_md(ckpt, md)


def _saved(obj) -> bytes:
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_value_of_shared_lists_is_refused_before_it_is_copied_out(ckpt):
    """A value that is 40 levels of lists of two references to the same list (1.5 KB) is refused, not copied into
    2**40 items (every reader hung, growing by hundreds of MB)."""
    inner: list = [1]
    for _ in range(40):
        inner = [inner, inner]
    _value_file(ckpt, "step", _saved(inner))
    assert "shared" in str(_refused_soon(ckpt, "convert.dcp_value", "step"))


def test_numpy_arrays_sharing_one_pickled_state_are_refused(ckpt):
    """2,000 numpy arrays built from one memoized state of 100 KB (a 100 KB value) are refused before they hold
    200 MB (each copied the state's bytes)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    state = (1, (100_000,), np.dtype("u1"), False, b"\x01" * 100_000)

    class Shared:
        def __reduce__(self):
            return _reconstruct, (np.ndarray, (0,), b"b"), state
    _value_file(ckpt, "step", _saved([Shared() for _ in range(2000)]))
    assert "more data than the value stores" in str(_refused_soon(ckpt, "convert.dcp_value", "step"))


def test_a_sparse_tensor_in_a_value_is_refused_naming_it(ckpt):
    """A value that is a sparse tensor: ``tensor.layout`` naming the leaf (a RuntimeError escaped from the load)."""
    _value_file(ckpt, "step", _saved(torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))))
    err = _refused_soon(ckpt, "tensor.layout", "step")
    assert err.file.endswith(".metadata"), str(err)
