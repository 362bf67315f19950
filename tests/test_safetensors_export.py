"""``xckpt convert --to safetensors``: Hugging Face shards and index, streamed, written atomically."""

import json
import os
import struct
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import xckpt
import xckpt.convert
from xckpt.cli import main as cli_main
from xckpt.engine import atomic
from xckpt.errors import XckptError, XckptWarning
from xckpt.format.manifest import ArrayEntry, Manifest
from xckpt.interop.safetensors import writer
from xckpt.interop.safetensors.writer import parse_size, pieces, plan_export, xckpt_to_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
import xckpt_torch  # noqa: E402,F401 - registers modules as containers

INPUT = torch.tensor([[1, 5, 9, 2, 77, 31, 4, 0]])


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    return cfg, transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    return cfg, transformers.LlamaForCausalLM(cfg)


def _headers(dst):
    """{file: (header dict, data bytes)} of every safetensors file in ``dst``, checked to be well formed."""
    out = {}
    for name in sorted(os.listdir(dst)):
        if not name.endswith(".safetensors"):
            continue
        with open(dst / name, "rb") as f:
            raw = f.read()
        n = struct.unpack("<Q", raw[:8])[0]
        assert n % 8 == 0
        head = json.loads(raw[8:8 + n])
        data = raw[8 + n:]
        assert head.pop("__metadata__") == {"format": "pt"}
        spans = sorted(tuple(h["data_offsets"]) for h in head.values())
        assert spans[0][0] == 0 and spans[-1][1] == len(data)  # contiguous, no holes, nothing after
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        out[name] = (head, data)
    return out


def _export_model(tmp_path, make, shard):
    torch.manual_seed(0)
    cfg, model = make()
    model.eval()
    xckpt.save({"model": model, "step": 1}, tmp_path / "ck")
    xckpt.convert.convert(str(tmp_path / "ck"), str(tmp_path / "hf"), target="safetensors", select="model",
                          max_shard_size=shard)
    return cfg, model


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_transformers_loads_the_export(tmp_path, make):
    cfg, model = _export_model(tmp_path, make, "40KB")
    files = _headers(tmp_path / "hf")
    assert len(files) >= 2
    names = [k for head, _ in files.values() for k in head]
    assert len(names) == len(set(names)) == len(model.state_dict())  # every tensor written once
    assert set(names) == set(model.state_dict())  # exactly model.state_dict() names
    cfg.save_pretrained(tmp_path / "hf")
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    back.eval()
    assert type(back) is type(model)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    want = dict(model.named_parameters())
    got = dict(back.named_parameters())
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    if cfg.model_type == "gpt2":  # lm_head is tied to wte: stored under both names, still one parameter
        assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(INPUT).logits, back(INPUT).logits)


def test_index_and_safe_open_agree_with_the_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    tree = {
        "net": {"layers": [{"w": rng.standard_normal((30, 40)).astype(np.float32),
                            "b": rng.standard_normal(40).astype(ml_dtypes.bfloat16)} for _ in range(3)],
                "emb": rng.standard_normal((50, 8)).astype(np.float16),
                "ids": np.arange(24, dtype=np.int64).reshape(2, 3, 4),
                "mask": rng.random(17) > 0.5,
                "q": rng.integers(-128, 127, size=(5, 7), dtype=np.int8),
                "u": np.arange(9, dtype=np.uint16),
                "f8": rng.standard_normal(33).astype(ml_dtypes.float8_e4m3fn),
                "scale": np.float64(2.5), "empty": np.zeros((0, 3), np.float32), "act": "gelu"},
        "opt": {"lr": 0.1}, "step": 7, "note": "x",
    }
    xckpt.save(tree, tmp_path / "ck")
    with pytest.warns(XckptWarning, match="skipped 1 non-array leaves.*net/act"):
        xckpt_to_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"), select="net/", max_shard_size=5000)
    flat = {f"layers.{i}.{k}": v for i, layer in enumerate(tree["net"]["layers"]) for k, v in layer.items()}
    flat.update({k: np.asarray(v) for k, v in tree["net"].items() if k not in ("layers", "act")})
    index = json.loads((tmp_path / "hf" / writer.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(flat)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in flat.values())
    files = _headers(tmp_path / "hf")
    assert set(index["weight_map"].values()) == set(files) and len(files) >= 3
    assert all(f == f"model-{i:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(sorted(files), 1))
    from safetensors import safe_open
    seen = set()
    for fname in files:
        with safe_open(str(tmp_path / "hf" / fname), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == fname
                t = f.get_tensor(name)
                want = flat[name]
                assert tuple(t.shape) == want.shape
                host = t.view(torch.uint8).numpy() if t.element_size() == 1 and t.dtype != torch.bool else None
                if host is not None:  # int8, float8: compare the bytes
                    np.testing.assert_array_equal(host.view(want.dtype), want)
                elif t.dtype == torch.bfloat16:
                    np.testing.assert_array_equal(t.view(torch.int16).numpy().view(want.dtype), want)
                else:
                    np.testing.assert_array_equal(t.numpy(), want)
                seen.add(name)
    assert seen == set(flat)
    dtypes_written = {h[name]["dtype"] for h, _ in files.values() for name in h}
    assert dtypes_written == {"F32", "BF16", "F16", "I64", "BOOL", "I8", "U16", "F8_E4M3", "F64"}


def test_one_file_and_no_index_when_it_fits(tmp_path):
    xckpt.save({"a": np.ones((10, 10), np.float32), "b": np.zeros(3, np.int32)}, tmp_path / "ck")
    xckpt_to_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"))  # default 5GB
    assert os.listdir(tmp_path / "hf") == [writer.SINGLE_FILE]
    (head, _), = _headers(tmp_path / "hf").values()
    assert head["a"] == {"dtype": "F32", "shape": [10, 10], "data_offsets": [0, 400]}
    assert head["b"] == {"dtype": "I32", "shape": [3], "data_offsets": [400, 412]}


def test_memory_stays_bounded(tmp_path):
    """200 MB in two 100 MB arrays: the export never holds a whole array, let alone the model."""
    rows, cols = 2500, 10_000
    xckpt.save({"big": {f"w{i}": np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + i
                        for i in range(2)}}, tmp_path / "ck")
    script = textwrap.dedent(f"""
        import json
        from xckpt.interop.safetensors.writer import xckpt_to_safetensors

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024

        try:  # reset the peak to the current resident size
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = status("VmRSS:")
        except OSError:
            base = status("VmHWM:")
        xckpt_to_safetensors({str(tmp_path / "ck")!r}, {str(tmp_path / "hf")!r}, select="big",
                             max_shard_size="150MB")
        print(json.dumps({{"growth": status("VmHWM:") - base}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=120)
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    assert growth < 80e6, f"peak RSS grew by {growth / 1e6:.0f} MB"
    from safetensors import safe_open
    index = json.loads((tmp_path / "hf" / writer.INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 2 * rows * cols * 4
    with safe_open(str(tmp_path / "hf" / index["weight_map"]["w1"]), framework="np") as f:
        part = f.get_slice("w1")[1234:1236]
        np.testing.assert_array_equal(part, np.arange(1234 * cols, 1236 * cols, dtype=np.float32).reshape(2, cols) + 1)


def _leftovers(tmp_path):
    return [n for n in os.listdir(tmp_path) if ".xckpt-" in n]


def test_existing_destination_and_overwrite(tmp_path, monkeypatch):
    xckpt.save({"w": np.ones(4, np.float32)}, tmp_path / "ck")
    xckpt.save({"w": np.full(4, 2, np.float32)}, tmp_path / "ck2")
    src, dst = str(tmp_path / "ck"), str(tmp_path / "hf")
    xckpt_to_safetensors(src, dst)
    before = (tmp_path / "hf" / writer.SINGLE_FILE).read_bytes()
    with pytest.raises(XckptError) as info:
        xckpt_to_safetensors(str(tmp_path / "ck2"), dst)
    assert info.value.code == "save.exists"
    assert (tmp_path / "hf" / writer.SINGLE_FILE).read_bytes() == before
    xckpt_to_safetensors(str(tmp_path / "ck2"), dst, overwrite=True)
    after = (tmp_path / "hf" / writer.SINGLE_FILE).read_bytes()
    assert after != before and after.endswith(np.full(4, 2, np.float32).tobytes())
    monkeypatch.setattr(atomic, "_renameat2", None)  # the replace without an atomic exchange
    xckpt_to_safetensors(src, dst, overwrite=True, max_shard_size=8)
    assert os.listdir(dst) == [writer.SINGLE_FILE]
    assert (tmp_path / "hf" / writer.SINGLE_FILE).read_bytes() == before
    # overwrite replaces only a safetensors export: not a checkpoint, not any directory
    for other in (tmp_path / "ck2", tmp_path / "stuff"):
        other.mkdir(exist_ok=True)
        (other / "keep.txt").write_text("mine")
        with pytest.raises(XckptError) as info:
            xckpt_to_safetensors(src, str(other), overwrite=True)
        assert info.value.code == "save.not_checkpoint"
        assert (other / "keep.txt").read_text() == "mine"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("index", [
    "truncated", '{"weight_map": {"w": "sub/model-00001-of-00002.safetensors"}}',
    '{"weight_map": {"w": "model-00001-of-00002.safetensors", "w": "model-00002-of-00002.safetensors"}}'])
def test_overwrite_refuses_an_export_whose_index_cannot_be_read(tmp_path, index):
    """An export whose index is cut short, points into a subfolder or names a tensor twice: which of its files
    are its own cannot be told, so --overwrite refuses (save.not_checkpoint naming the index), deleting
    nothing (the tokenizer.json put beside the shards included)."""
    xckpt.save({"model": {"w": np.ones(3, np.float32), "v": np.zeros(4, np.float32)}}, tmp_path / "ck")
    dst = tmp_path / "hf"
    args = ["convert", "--to", "safetensors", "--select", "model", "--max-shard-size", "8"]
    assert cli_main([*args, str(tmp_path / "ck"), str(dst)]) == 0
    idx = dst / "model.safetensors.index.json"
    idx.write_text(idx.read_text()[:20] if index == "truncated" else index)
    (dst / "tokenizer.json").write_text('{"tok": 1}')
    (dst / "sub").mkdir()
    (dst / "sub" / "notes.txt").write_text("mine")
    before = {p.relative_to(dst): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    with pytest.raises(XckptError) as info:
        xckpt.convert.convert(str(tmp_path / "ck"), str(dst), target="safetensors", select="model",
                              max_shard_size=8, overwrite=True)
    assert (info.value.code, info.value.file) == ("save.not_checkpoint", str(idx)), info.value
    assert cli_main([*args, "--overwrite", str(tmp_path / "ck"), str(dst)]) == 2
    assert {p.relative_to(dst): p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before
    assert _leftovers(tmp_path) == []


def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    xckpt.save({"m": {"a": np.ones(4, np.float32), "z": np.ones(3, np.complex128)}}, tmp_path / "bad")
    with pytest.raises(XckptError) as info:
        xckpt_to_safetensors(str(tmp_path / "bad"), str(tmp_path / "out"), select="m")
    assert info.value.code == "convert.safetensors_dtype" and info.value.leaf == "m/z"
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []

    xckpt.save({f"w{i}": np.full((8, 8), i, np.float32) for i in range(4)}, tmp_path / "ck")
    calls = []

    def failing(ckpt, entry, region):
        calls.append(entry.key)
        if len(calls) == 3:
            raise XckptError("disk on fire", code="io.read")
        return np.full(region.sizes, 1, np.float32)

    monkeypatch.setattr(writer, "read_region", failing)
    with pytest.raises(XckptError, match="disk on fire"):
        xckpt_to_safetensors(str(tmp_path / "ck"), str(tmp_path / "out"), max_shard_size=300)
    assert len(calls) == 3 and not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
    monkeypatch.undo()
    xckpt_to_safetensors(str(tmp_path / "ck"), str(tmp_path / "out"))
    old = (tmp_path / "out" / writer.SINGLE_FILE).read_bytes()
    monkeypatch.setattr(writer, "read_region", failing)
    calls.clear()
    with pytest.raises(XckptError, match="disk on fire"):
        xckpt_to_safetensors(str(tmp_path / "ck"), str(tmp_path / "out"), overwrite=True, max_shard_size=300)
    assert os.listdir(tmp_path / "out") == [writer.SINGLE_FILE]  # the previous export is untouched
    assert (tmp_path / "out" / writer.SINGLE_FILE).read_bytes() == old and _leftovers(tmp_path) == []


def test_cli(tmp_path, capsys):
    torch.manual_seed(0)
    _, model = _gpt2()
    xckpt.save({"model": model, "optim": {"lr": np.float32(0.1)}, "step": 3}, tmp_path / "ck")
    rc = cli_main(["convert", "--to", "safetensors", "--select", "model", "--max-shard-size", "100KB",
                   str(tmp_path / "ck"), str(tmp_path / "hf")])
    assert rc == 0
    index = json.loads((tmp_path / "hf" / writer.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert len(set(index["weight_map"].values())) == 2
    for flags in (["--select", "model"], ["--max-shard-size", "1GB"]):
        rc = cli_main(["convert", *flags, str(tmp_path / "ck"), str(tmp_path / "copy")])
        assert rc == 2 and not (tmp_path / "copy").exists()
        err = capsys.readouterr().err
        assert "convert.option" in err and flags[0] in err and "--to safetensors" in err
    rc = cli_main(["convert", "--to", "safetensors", "--max-shard-size", "lots", str(tmp_path / "ck"),
                   str(tmp_path / "hf2")])
    assert rc == 2 and "convert.safetensors_size" in capsys.readouterr().err
    rc = cli_main(["convert", "--to", "safetensors", str(tmp_path / "ck"), str(tmp_path / "hf3")])
    assert rc == 0 and "warning: " in capsys.readouterr().err  # step skipped, named
    with pytest.raises(SystemExit):
        cli_main(["convert", "--help"])
    assert "--to safetensors --select model" in capsys.readouterr().out


def test_convert_refuses_options_a_converter_does_not_take(tmp_path):
    xckpt.save({"w": np.ones(2)}, tmp_path / "ck")
    with pytest.raises(XckptError) as info:
        xckpt.convert.convert(str(tmp_path / "ck"), str(tmp_path / "c"), select="w")
    assert info.value.code == "convert.option" and not (tmp_path / "c").exists()
    xckpt.convert.convert(str(tmp_path / "ck"), str(tmp_path / "c"), select=None)  # None: no option given
    assert (tmp_path / "c" / "xckpt.json").exists()


def test_sizes_names_and_pieces():
    assert parse_size(None) == 5 * 10**9
    assert [parse_size(s) for s in ("5GB", "200MB", "500KB", "2GiB", "1.5kb", "123", 77)] == \
        [5 * 10**9, 200 * 10**6, 500 * 10**3, 2 << 30, 1500, 123, 77]
    for bad in ("5XB", "", "GB", "-1", 0, "nan", True):
        with pytest.raises(XckptError) as info:
            parse_size(bad)
        assert info.value.code == "convert.safetensors_size"

    def entry(key, shape=(2,)):
        return ArrayEntry(key, ".".join(key), shape, "float32", "float32", shape, shape)

    m = Manifest({}, [entry(("a", "b.c")), entry(("a.b", "c"))], {})
    with pytest.raises(XckptError) as info:
        plan_export(m)
    assert info.value.code == "convert.safetensors_name"
    m = Manifest({}, [entry(("model", "x")), entry(("model", "y", "z"), (100,)), entry(("other",))], {})
    with pytest.raises(XckptError) as info:
        plan_export(m, select="nothing")
    assert info.value.code == "convert.safetensors_select" and "model" in info.value.message
    with pytest.raises(XckptError) as info:
        plan_export(m, select="model/x")
    assert info.value.code == "convert.safetensors_select"
    plan = plan_export(m, select="model", max_shard_size=100)  # y.z (400 bytes) alone in a file
    assert [(f, [t.name for t in ts]) for f, ts in plan.files] == \
        [("model-00001-of-00002.safetensors", ["x"]), ("model-00002-of-00002.safetensors", ["y.z"])]
    assert plan.total_size == 408

    a = np.arange(3 * 5 * 7 * 2, dtype=np.float32).reshape(3, 5, 7, 2)
    for piece_bytes in (1, 20, 56, 60, 100, 1000, 10**6):
        regions = list(pieces(a.shape, 4, piece_bytes))
        assert all(r.numel * 4 <= max(piece_bytes, 4) for r in regions)
        np.testing.assert_array_equal(np.concatenate([a[r.slices()].ravel() for r in regions]), a.ravel())
    assert list(pieces((0, 4), 4)) == [] and [r.sizes for r in pieces((), 8)] == [()]


def _flax_run(family, path, architectures=False):
    """A flax model of ``family`` and its torch class; its params and AdamW state saved to ``path``."""
    pytest.importorskip("jax")
    import optax

    if family == "gpt2":
        cfg, _ = _gpt2()
        torch_cls, flax_cls = transformers.GPT2LMHeadModel, transformers.FlaxGPT2LMHeadModel
    else:
        cfg, _ = _llama()
        torch_cls, flax_cls = transformers.LlamaForCausalLM, transformers.FlaxLlamaForCausalLM
    if architectures:
        cfg.architectures = [torch_cls.__name__]
    flax_model = flax_cls(cfg, seed=5)
    xckpt.save({"params": flax_model.params, "opt_state": optax.adamw(1e-3).init(flax_model.params), "step": 3}, path)
    return cfg, torch_cls, flax_model


def _loads_as_transformers_converts(dst, cfg, torch_cls, flax_model):
    """``from_pretrained(dst)``, checked element by element against transformers' own flax -> torch conversion."""
    from transformers.modeling_flax_pytorch_utils import load_flax_weights_in_pytorch_model

    loaded = torch_cls.from_pretrained(dst).eval()
    want = load_flax_weights_in_pytorch_model(torch_cls(cfg), flax_model.params).eval()
    got_sd, want_sd = loaded.state_dict(), want.state_dict()
    assert list(got_sd) == list(want_sd)
    for k, v in want_sd.items():
        assert torch.equal(got_sd[k], v), k
    return loaded


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_flax_checkpoint_exported_with_hugging_face_torch_names(tmp_path, family):
    """A flax/optax training checkpoint goes to safetensors under the torch model's names and layouts through
    ``M.flax_to_torch()``, resolved against a skeleton on the meta device; ``from_pretrained`` loads it and
    equals transformers' own flax -> torch conversion, logits included."""
    from xckpt import mapping as M

    src, dst = str(tmp_path / "flax"), str(tmp_path / "hf")
    cfg, torch_cls, flax_model = _flax_run(family, src)
    with torch.device("meta"):
        skeleton = torch_cls(cfg)
    xckpt.convert.convert(src, dst, target="safetensors", select="model", max_shard_size="20KB",
                          mapping=M.flax_to_torch(), like={"model": skeleton})
    assert os.path.exists(os.path.join(dst, "model.safetensors.index.json"))
    cfg.save_pretrained(dst)
    loaded = _loads_as_transformers_converts(dst, cfg, torch_cls, flax_model)
    with torch.no_grad():
        logits = loaded(INPUT).logits.numpy()
    np.testing.assert_allclose(logits, np.asarray(flax_model(INPUT.numpy(), params=flax_model.params).logits),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cli_exports_a_flax_checkpoint_for_a_hugging_face_config(tmp_path, family, capsys):
    """``--mapping flax-to-torch --hf-config`` builds the torch model the config describes on the meta device
    (its ``architectures`` class, else the causal LM of its type), exports the flax/optax checkpoint under its
    names, and puts the config beside the weights: ``from_pretrained`` loads the directory as it is and equals
    transformers' own flax -> torch conversion."""
    src, dst, conf = tmp_path / "flax", tmp_path / "hf", tmp_path / "conf"
    # GPT-2's config names no architectures (the causal LM of its type is built); Llama's does
    cfg, torch_cls, flax_model = _flax_run(family, src, architectures=family == "llama")
    cfg.save_pretrained(conf)
    rc = cli_main(["convert", "--to", "safetensors", "--select", "model", "--mapping", "flax-to-torch",
                   "--hf-config", str(conf), str(src), str(dst)])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((dst / "config.json").read_text()) == json.loads((conf / "config.json").read_text())
    _loads_as_transformers_converts(dst, cfg, torch_cls, flax_model)
    if family != "gpt2":
        return
    # an export over a previous one (--overwrite) replaces it whole, and gets the config again
    (dst / "config.json").write_text("{}")
    rc = cli_main(["convert", "--to", "safetensors", "--select", "model", "--mapping", "flax-to-torch",
                   "--hf-config", str(conf / "config.json"), "--overwrite", str(src), str(dst)])
    assert rc == 0 and json.loads((dst / "config.json").read_text()) == json.loads((conf / "config.json").read_text())
    capsys.readouterr()
    # refusals: each names what is wrong, and nothing is written
    bad = [(["--mapping", "flax-to-torch", "--select", "model"], "convert.option", "--hf-config"),
           (["--hf-config", str(conf), "--select", "model"], "convert.option", "--mapping"),
           (["--mapping", "flax-to-torch", "--hf-config", str(conf)], "convert.option", "--select"),
           (["--mapping", "flax-to-torch", "--hf-config", str(tmp_path / "nowhere"), "--select", "model"],
            "convert.hf_config", str(tmp_path / "nowhere"))]
    for flags, code, named in bad:
        rc = cli_main(["convert", "--to", "safetensors", *flags, str(src), str(tmp_path / "refused")])
        err = capsys.readouterr().err
        assert rc == 2 and code in err and named in err, (flags, err)
        assert not (tmp_path / "refused").exists()
    rc = cli_main(["convert", "--mapping", "flax-to-torch", "--hf-config", str(conf), "--select", "model", str(src),
                   str(tmp_path / "refused")])
    assert rc == 2 and "--to safetensors" in capsys.readouterr().err and not (tmp_path / "refused").exists()


_BAD_CONFIGS = {
    "a JSON list": "[1, 2]",
    "nested too deeply": '{"model_type": "gpt2", "x": ' + "[" * 100000 + "]" * 100000 + "}",
    "architectures a string": '{"model_type": "gpt2", "architectures": "GPT2LMHeadModel"}',
    "architectures not names": '{"model_type": "gpt2", "architectures": [3]}',
    "a size of the wrong type": '{"model_type": "gpt2", "n_embd": "x", "n_head": 2}',
    "sizes too large to build": '{"model_type": "gpt2", "n_layer": 1, "n_embd": 8000000000, "n_head": 2}',
}


@pytest.mark.parametrize("raw", list(_BAD_CONFIGS.values()), ids=list(_BAD_CONFIGS))
def test_hf_config_that_builds_no_model_is_refused(tmp_path, raw, capsys):
    """``--hf-config`` naming a config.json that is no configuration, or whose values build no model, is
    ``convert.hf_config`` naming the file (exit 2, nothing written), never a raw exception."""
    from xckpt_torch.hf import model_from_config

    conf = tmp_path / "config.json"
    conf.write_text(raw)
    with pytest.raises(XckptError) as info:
        model_from_config(str(conf))
    assert info.value.code == "convert.hf_config" and info.value.file == str(conf), info.value
    src = tmp_path / "flax"
    xckpt.save({"params": {"wte": {"embedding": np.zeros((4, 2), np.float32)}}}, src)
    rc = cli_main(["convert", "--to", "safetensors", "--select", "model", "--mapping", "flax-to-torch",
                   "--hf-config", str(conf), str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "convert.hf_config" in err and str(conf) in err, err
    assert not (tmp_path / "out").exists()
