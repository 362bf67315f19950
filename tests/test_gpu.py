"""The CUDA paths on a real GPU: PyTorch DTensors on CUDA (one process over NCCL; two processes sharing
the GPU over gloo) save, validate, load onto another placement and train on exactly; ``save_async``
returns before the writing and keeps the values of when it was called; JAX arrays on the GPU; a
torch-CUDA checkpoint into JAX GPU arrays and back. Skipped where no CUDA GPU is visible."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from torch_workers import run_group  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("backend, world, parallel", [("nccl", 1, "fsdp"), ("gloo", 2, "fsdp"), ("gloo", 2, "tp")])
def test_torch_cuda_train_save_load_resume(tmp_path, backend, world, parallel):
    results = run_group(world, "gpu_workers:train_resume", tmp_path, backend=backend, timeout=300, parallel=parallel)
    for r in results:
        assert r["sync"] == r["async"] == 1 and r["bf16"] == "torch.bfloat16"  # one exact resume of each
        assert r["returned_early"], "save_async returned only after its writing was done"
        assert r["early_copies"] > 0, "a second save_async started no copy while describing"


def test_torch_cuda_to_jax_gpu_and_back(tmp_path):
    run_group(1, "gpu_workers:cross_save", tmp_path, backend="nccl")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(HERE, "gpu_workers.py"), "jax", str(tmp_path)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0 and "jax gpu ok" in text, text[-6000:]
    run_group(1, "gpu_workers:cross_load", tmp_path, backend="nccl")


def test_staging_buffers_stay_page_locked_while_any_view_of_them_lives():
    import gc

    import numpy as np
    from xckpt_torch.staging import pinned_buffer

    buf = pinned_buffer(3 << 20)
    gc.collect()
    assert torch.from_numpy(buf).is_pinned()
    view = buf.view(np.float32).reshape(3, -1)
    del buf
    gc.collect()
    assert torch.from_numpy(view).is_pinned()  # the core keeps views of its buffers only while it writes them


def test_cuda_targets_load_exactly_and_an_expanded_one_is_refused_before_anything_is_written(tmp_path):
    """CUDA tensors are filled through torch's ``copy_``; one whose elements share memory (expanded) is
    refused before any other target is written, and plain ones (float32, and bfloat16 by a cast) load exactly."""
    import numpy as np

    import xckpt

    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    xckpt.save({"x": x, "y": np.full(2, 7, np.float32)}, tmp_path / "c")
    y = torch.zeros(2, device="cuda")
    with pytest.raises(xckpt.XckptError) as e:
        xckpt.load(tmp_path / "c", like={"y": y, "x": torch.zeros(2, device="cuda").expand(3, 2)})
    assert (e.value.code, e.value.leaf) == ("shape.mismatch", "x") and "share memory" in str(e.value)
    assert (y == 0).all().item()
    out = xckpt.load(tmp_path / "c", like={"y": y, "x": torch.zeros(3, 2, device="cuda", dtype=torch.bfloat16)})
    assert out["x"].device.type == "cuda" and out["x"].dtype == torch.bfloat16
    np.testing.assert_array_equal(out["x"].float().cpu().numpy(), x)  # small integers: exact in bfloat16
    np.testing.assert_array_equal(y.cpu().numpy(), np.full(2, 7, np.float32))  # in place
