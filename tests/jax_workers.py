"""Worker processes of the multi-process JAX tests: real jax.distributed on CPU, 4 host devices each.

Run as ``python tests/jax_workers.py PHASE RANK NPROCS PORT WORKDIR``. Every check is
made inside the worker (values compared element by element); a failure exits non-zero
with its traceback, which the test prints.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker: 4 host devices (the test process imports this module for its data)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import xckpt  # noqa: E402
import xckpt.registry  # noqa: E402


def expected() -> dict:
    """The global values every test saves (the same on every process)."""
    return {
        "w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 7,
        "e": (np.arange(8 * 16, dtype=np.float32).reshape(8, 16) - 40).astype(ml_dtypes.bfloat16),
        "i": np.arange(8 * 6, dtype=np.int32).reshape(8, 6) * -3,
        "r": np.linspace(0, 1, 15, dtype=np.float32).reshape(5, 3),
        "f8": (np.arange(64, dtype=np.float32).reshape(8, 8) / 8).astype(ml_dtypes.float8_e4m3fn),
        "n": np.arange(10, dtype=np.int64),
    }


SPECS = {"w": P("x", "y"), "e": P(("x", "y")), "i": P("y"), "r": P(), "f8": P("x")}


def make_tree(mesh: Mesh) -> dict:
    """The saved tree: global jax.Arrays built from each process's own slices (no collective)."""
    exp = expected()
    arrays = {k: jax.make_array_from_callback(exp[k].shape, NamedSharding(mesh, spec), lambda idx, a=exp[k]: a[idx])
              for k, spec in SPECS.items()}
    return {"params": {k: arrays[k] for k in ("w", "e", "i")}, "opt": {"r": arrays["r"], "f8": arrays["f8"]},
            "n": exp["n"], "step": 1000, "name": "run-1"}


def check_local(arr: jax.Array, want: np.ndarray, sharding: NamedSharding) -> None:
    """Every addressable shard of ``arr`` holds ``want``'s slice, on ``sharding``."""
    assert arr.sharding == sharding, (arr.sharding, sharding)
    assert arr.dtype == want.dtype, (arr.dtype, want.dtype)
    assert len(arr.addressable_shards) == jax.local_device_count()
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def phase_save(rank: int, workdir: str) -> None:
    from xckpt.engine import protocol
    from xckpt_jax import JaxCoordinator, array_source

    coord = xckpt.registry.default_coordinator()
    assert isinstance(coord, JaxCoordinator), coord
    assert (coord.rank, coord.world_size) == (rank, 2)
    assert coord.all_gather_bytes(f"r{rank}".encode()) == [b"r0", b"r1"]
    assert coord.broadcast_bytes(b"root" if rank == 1 else None, root=1) == b"root"
    coord.barrier()

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    tree = make_tree(mesh)
    # this process lists only the regions its own devices hold, each once
    src = array_source(tree["params"]["w"])
    mine = {tuple((s.start, s.stop) for s in sh.index) for sh in tree["params"]["w"].addressable_shards}
    assert {tuple(zip(s.region.offsets, s.region.ends)) for s in src.shards} == mine and len(src.shards) == 4
    assert len(array_source(tree["opt"]["r"]).shards) == 1
    assert coord.gather_bytes(f"g{rank}".encode()) == ([b"g0", b"g1"] if rank == 0 else None)
    assert coord.scatter_bytes([b"s0", b"s1"] if rank == 0 else None) == f"s{rank}".encode()
    # replicas are written once, the bytes spread over both processes
    p = protocol.prepare(tree, os.path.join(workdir, "sync"))
    assert p.descs.leaves[0].layout is not None  # a NamedSharding: described by its layout, not its regions
    protocol.write(p)
    protocol.commit(p)
    total = sum(int(np.asarray(v).nbytes) for v in expected().values())
    assert p.bytes_written >= 0.3 * total, (p.bytes_written, total)
    if rank == 0:
        assert sum(p.stats["bytes_per_rank"]) == total, (p.stats["bytes_per_rank"], total)

    handle = xckpt.save_async(tree, os.path.join(workdir, "async"))
    manifest = handle.wait()
    if rank == 0:
        assert manifest.by_key()[("params", "w")].shape == (16, 8)
    else:
        assert manifest is None
    for name in ("sync", "async"):
        assert os.path.exists(os.path.join(workdir, name, "xckpt.json"))
    coord.barrier()  # rank 0's wait() returns once the status directory every process read is removed
    assert not [n for n in os.listdir(workdir) if n.startswith(".")], os.listdir(workdir)
    # a destination that cannot be written (its parent is a file) fails the save on every process: when
    # the coordinating process takes its hold, before any process writes
    try:
        xckpt.save_async(tree, os.path.join(workdir, "blocker", "ckpt")).wait()
    except xckpt.XckptError as exc:
        assert "nothing was written" in str(exc) and "blocker" in str(exc), exc
    else:
        raise AssertionError("a save under a regular file reported success")
    xckpt.save({"after": tree["params"]["w"]}, os.path.join(workdir, "after"))  # the next save goes ahead

    # the accelerator path (page-locked host copies, kept as fetched; a later save starts the copies of
    # the boxes this process wrote as each array is described), run on these CPU devices, which offer
    # the pinned_host memory kind too; the arrays are deleted as soon as the second save returns
    from xckpt.engine import background
    from xckpt_jax import arrays
    for d in jax.local_devices():
        arrays._pinned[d] = True
    xckpt.save_async(tree, os.path.join(workdir, "pinned1")).wait()
    staged = len(background._staging.device_shards)
    assert staged > 0
    doubled = jax.jit(lambda t: jax.tree.map(lambda a: a * 2, t))({"params": tree["params"], "opt": tree["opt"]})
    handle = xckpt.save_async({**tree, **doubled}, os.path.join(workdir, "pinned2"))
    for a in jax.tree.leaves(doubled):
        a.delete()
    handle.wait()
    assert handle.stats["early_copies"] == staged, (handle.stats, staged)


def phase_load(rank: int, workdir: str) -> None:
    from xckpt_jax import sharded_target

    exp = expected()
    devices = np.array(jax.devices()[::-1])  # process 1's devices now come first
    mesh24 = Mesh(devices.reshape(2, 4), ("x", "y"))
    mesh8 = Mesh(devices, ("d",))
    shardings = {"w": NamedSharding(mesh24, P("y", "x")), "e": NamedSharding(mesh8, P(None, "d")),
                 "i": NamedSharding(mesh24, P(("x", "y"))), "r": NamedSharding(mesh8, P()),
                 "f8": NamedSharding(mesh24, P(None, "y"))}
    # this process reads only what its 4 devices hold: half of an array split 8 ways
    regions = sharded_target((16, 8), np.float32, NamedSharding(mesh8, P("d"))).regions
    assert len(regions) == 4 and sum(r.numel for r in regions) == 64
    assert len(sharded_target((5, 3), np.float32, shardings["r"]).regions) == 1

    for name in ("sync", "async"):
        like = {"params": {k: jax.ShapeDtypeStruct(exp[k].shape, exp[k].dtype, sharding=shardings[k])
                           for k in ("w", "e", "i")},
                "opt": {k: jax.ShapeDtypeStruct(exp[k].shape, exp[k].dtype, sharding=shardings[k])
                        for k in ("r", "f8")},
                "n": np.zeros(10, np.int64), "step": 0, "name": ""}
        out = xckpt.load(os.path.join(workdir, name), like=like)
        for k in ("w", "e", "i"):
            check_local(out["params"][k], exp[k], shardings[k])
        for k in ("r", "f8"):
            check_local(out["opt"][k], exp[k], shardings[k])
        np.testing.assert_array_equal(out["n"], exp["n"])
        assert out["step"] == 1000 and out["name"] == "run-1"
    # a target whose mesh holds process 0's devices only: process 1 gets an array with no shard of its own
    only0 = NamedSharding(Mesh(np.array([d for d in jax.devices() if d.process_index == 0]), ("p",)), P("p"))
    got = xckpt.load(os.path.join(workdir, "sync"), partial=True,
                     like={"params": {"w": jax.ShapeDtypeStruct(exp["w"].shape, exp["w"].dtype, sharding=only0)}})
    w = got["params"]["w"]
    assert w.sharding == only0 and w.dtype == exp["w"].dtype and len(w.addressable_shards) == (4 if rank == 0 else 0)
    for shard in w.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), exp["w"][shard.index])
    # a collective load: process 1's target names a leaf the checkpoint lacks; both processes raise one
    # CollectiveLoadError naming it, and neither returns
    like = {"params": {"w": jax.ShapeDtypeStruct(exp["w"].shape, exp["w"].dtype, sharding=shardings["w"])}}
    if rank == 1:
        like["params"]["nope"] = np.zeros(3, np.float32)
    try:
        xckpt.load(os.path.join(workdir, "sync"), like=like, partial=True)
    except xckpt.CollectiveLoadError as exc:
        assert sorted(exc.failures) == [1] and exc.code == "tree.key_mismatch", exc
        assert "params/nope" in exc.failures[1]["message"], exc
    else:
        raise AssertionError(f"a load whose target differs on process 1 returned on process {rank}")


def main() -> None:
    phase, rank, nprocs, port, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nprocs, process_id=rank)
    assert jax.process_count() == nprocs and jax.device_count() == 4 * nprocs
    {"save": phase_save, "load": phase_load}[phase](rank, workdir)
    print(f"OK {phase} {rank}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
