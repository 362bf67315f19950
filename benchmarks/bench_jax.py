"""xckpt against Orbax ``StandardCheckpointer`` in one JAX process with 8 host CPU devices.

Per workload (``--workload w1|w2|all``), in one process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set here before jax is imported)
and ``jax_enable_x64`` (for the int64 step):

* the tree lives on a 4-device mesh ``('x',)``: matrices ``NamedSharding(mesh4, P('x', None))``,
  vectors and the step replicated (``P()``);
* save: ``xckpt.save(tree, path)`` against ``ocp.StandardCheckpointer()`` (defaults)
  ``save(path, tree)`` + ``wait_until_finished()``;
* restore onto a 2-device mesh: the target is a tree of ``jax.ShapeDtypeStruct(shape, dtype,
  sharding=NamedSharding(mesh2, P(None, 'x')))`` (vectors and step ``P()``), given to
  ``xckpt.load(path, like=abstract)`` and to ``StandardCheckpointer().restore(path, abstract)``;
  both are followed by ``jax.block_until_ready`` inside the timed region;
* every restored array is checked: its sharding must be the requested one and every
  addressable shard must equal the saved values element by element (else it raises);
* raw reference (no goal): the same tree as numpy arrays, one file per array, 2 threads,
  ``tofile`` + flush + ``os.fsync`` / ``np.fromfile``.

After an untimed warm-up round at full size, methods are interleaved ``--repeats`` times,
their order reversed every other run (xckpt, Orbax, raw; raw, Orbax, xckpt; ...); each run
saves into a fresh directory under ``--root`` (default /dev/shm), loads it back, and deletes it before the next
run (one checkpoint at a time); tables show medians.
Peak RSS is the kernel's high-water mark, reset before the call (:class:`_common.PeakRSS`);
bytes read is the /proc/self/io ``rchar`` delta around the load call.

Run (full size, both workloads, then a quick reduced-size check)::

    .venv/bin/python benchmarks/bench_jax.py --workload all --repeats 3
    .venv/bin/python benchmarks/bench_jax.py --workload w1 --scale 0.1 --repeats 1
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import sys  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import _common as C  # noqa: E402

jax.config.update("jax_enable_x64", True)
METHODS = ("xckpt", "Orbax", "raw")


def meshes() -> tuple[Mesh, Mesh]:
    """The 4-device mesh the tree is saved from and the 2-device mesh it is restored onto."""
    devices = jax.devices()
    if len(devices) < 4:
        raise RuntimeError(f"need 8 host devices (XLA_FLAGS), got {len(devices)}")
    return Mesh(np.array(devices[:4]), ("x",)), Mesh(np.array(devices[:2]), ("x",))


def source_tree(wl: C.Workload, mesh4: Mesh) -> dict[str, jax.Array]:
    """The tree to save: matrices ``P('x', None)`` on ``mesh4``, vectors and the step replicated."""
    shard, rep = NamedSharding(mesh4, P("x", None)), NamedSharding(mesh4, P())
    tree: dict[str, jax.Array] = {}
    for keys, shape, sharding in ((wl.matrices, (wl.side, wl.side), shard), (wl.vectors, (wl.vec_len,), rep)):
        for k in keys:
            tree[k] = jax.make_array_from_callback(
                shape, sharding, lambda idx, seed=wl.seed(k), shape=shape: C.pattern(seed, shape, idx))
    tree["step"] = jax.device_put(np.array(C.STEP, np.int64), rep)
    if tree["step"].dtype != np.int64:
        raise RuntimeError("the step is not int64 (jax_enable_x64 is off)")
    return tree


def abstract_tree(wl: C.Workload, mesh2: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The restore target: ``jax.ShapeDtypeStruct`` leaves, matrices ``P(None, 'x')`` on ``mesh2``, the rest ``P()``."""
    shard, rep = NamedSharding(mesh2, P(None, "x")), NamedSharding(mesh2, P())
    out = {k: jax.ShapeDtypeStruct((wl.side, wl.side), np.float32, sharding=shard) for k in wl.matrices}
    out.update({k: jax.ShapeDtypeStruct((wl.vec_len,), np.float32, sharding=rep) for k in wl.vectors})
    out["step"] = jax.ShapeDtypeStruct((), np.int64, sharding=rep)
    return out


def verify(got: Any, like: dict[str, jax.ShapeDtypeStruct], want: dict[str, np.ndarray], where: str) -> None:
    """Check every restored array's sharding and every addressable shard's values; raise on a difference."""
    if not isinstance(got, dict) or set(got) != set(like):
        raise AssertionError(f"{where}: restored keys differ from the target's")
    for k, spec in like.items():
        arr = got[k]
        if not isinstance(arr, jax.Array):
            raise AssertionError(f"{where}: {k!r} restored as {type(arr).__name__}, not a jax.Array")
        if arr.shape != spec.shape or arr.dtype != spec.dtype or \
                not arr.sharding.is_equivalent_to(spec.sharding, len(spec.shape)):
            raise AssertionError(f"{where}: {k!r} restored as {arr.dtype}{list(arr.shape)} {arr.sharding}, "
                                 f"want {spec.dtype}{list(spec.shape)} {spec.sharding}")
        for s in arr.addressable_shards:
            C.check_equal(k, np.asarray(s.data), want[k][s.index], f"{where} (device {s.device})")


def run(wl: C.Workload, repeats: int, ckptr: Any) -> C.Table:
    """Measure ``wl``: save from 4 devices and restore onto 2 with xckpt, Orbax and raw files; return the table."""
    import xckpt

    mesh4, mesh2 = meshes()
    C.log(f"{wl.name} jax: building the tree ({C.size_note(wl)})")
    holder = {"tree": source_tree(wl, mesh4)}  # dropped after the runs, freeing the device buffers
    like = abstract_tree(wl, mesh2)
    want = C.full_arrays(wl)
    jax.block_until_ready(holder["tree"])

    def save(m: str, path: str) -> None:
        """Save with method ``m``."""
        if m == "xckpt":
            xckpt.save(holder["tree"], path)
        elif m == "Orbax":
            ckptr.save(path, holder["tree"])
            ckptr.wait_until_finished()
        else:
            C.raw_save(want, path)

    def load(m: str, path: str) -> Any:
        """Restore with method ``m`` (onto mesh2 for xckpt and Orbax)."""
        if m == "xckpt":
            return jax.block_until_ready(xckpt.load(path, like=like))
        if m == "Orbax":
            return jax.block_until_ready(ckptr.restore(path, like))
        return C.raw_load(want, path)

    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for rep, order in C.rounds(METHODS, repeats):
        for m in order:  # save, load, check, delete: one checkpoint under the root at a time
            root = C.fresh_dir(f"jax-{wl.name}-{m}")
            try:
                path = os.path.join(root, "ckpt")
                saved, _ = C.measure(lambda: save(m, path))
                files = C.count_files(path)
                loaded, got = C.measure(lambda: load(m, path))
            finally:
                C.remove(root)
            if m == "raw":
                for k, a in want.items():
                    C.check_equal(k, got[k], a, f"{wl.name} raw load, {C.run_name(rep)}")
            else:
                verify(got, like, want, f"{wl.name} jax {m} restore, {C.run_name(rep)}")
            del got
            if rep is not None:
                runs[m].append({"save": saved.seconds, "load": loaded.seconds, "rchar": loaded.rchar,
                                "save_peak": saved.peak_rss, "load_peak": loaded.peak_rss,
                                "save_growth": saved.growth, "load_growth": loaded.growth, "files": files})
            C.log(f"{wl.name} jax {m:<5} {C.run_name(rep)}: save {saved.seconds:.2f} s, "
                  f"load {loaded.seconds:.2f} s, verified")
    holder.clear()

    def med(m: str, key: str) -> float:
        """Median over runs."""
        return C.median(r[key] for r in runs[m])

    def row(key: str, scale: float = 1.0) -> list[float]:
        """One quantity for every method."""
        return [med(m, key) / scale for m in METHODS]

    t = C.Table(f"{wl.title} jax (1 process, 8 CPU devices: save P('x',None) on 4, restore P(None,'x') on 2), "
                f"{C.ROOT}, median of {repeats}\n"
                f"  {C.size_note(wl)}; raw = 2 threads, tofile+fsync / fromfile (reference)", list(METHODS))
    t.add("save s", row("save"), goal=C.Goal("<=", 0.5 if wl.name == "w1" else 0.3))
    t.add("load s", row("load"), goal=C.Goal("<=", 0.5 if wl.name == "w1" else 0.3))
    if wl.name == "w2":
        t.add("files", row("files"), fmt="{:.0f}")
        return t
    need = wl.need_bytes(1)
    rx, ro = med("xckpt", "rchar"), med("Orbax", "rchar")
    t.add("load: bytes read GB", row("rchar", C.GB), fmt="{:.3f}", goal=C.Goal("<=", 1.10, "<=1.10 x need", rx / need),
          note=f"need {need / C.GB:.3f} GB: xckpt {rx / need:.2f} x need, Orbax {ro / need:.2f} x")
    t.add("save: peak RSS all procs GB", row("save_peak", C.GB))
    t.add("load: peak RSS all procs GB", row("load_peak", C.GB))
    t.add("save: peak RSS growth MiB", row("save_growth", C.MiB), fmt="{:.0f}")
    t.add("load: peak RSS growth MiB", row("load_growth", C.MiB), fmt="{:.0f}",
          note=f"the restored tree is {wl.total_bytes / C.MiB:.0f} MiB")
    return t


def main() -> int:
    """Parse flags, run the selected workloads, print one table each (exit 1 on a failed goal with --strict)."""
    args = C.parse(C.common_args(__doc__.splitlines()[0]))
    C.log_xckpt()
    warnings.filterwarnings("ignore")
    import orbax.checkpoint as ocp

    import xckpt

    mesh4, mesh2 = meshes()
    # warm-up: imports, thread pools, compilation of nothing in particular
    warm = {"warm": jax.device_put(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), NamedSharding(mesh4, P("x")))}
    warm_like = {"warm": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=NamedSharding(mesh2, P(None, "x")))}
    ckptr = ocp.StandardCheckpointer()
    root = C.fresh_dir("jax-warm")
    try:
        xckpt.save(warm, os.path.join(root, "x"))
        jax.block_until_ready(xckpt.load(os.path.join(root, "x"), like=warm_like))
        ckptr.save(os.path.join(root, "o"), warm)
        ckptr.wait_until_finished()
        jax.block_until_ready(ckptr.restore(os.path.join(root, "o"), warm_like))
    finally:
        C.remove(root)
    tables = []
    for wl in C.workloads(args.workload, args.scale):
        tables.append(run(wl, args.repeats, ckptr))
        tables[-1].print()
    ckptr.close()
    return 1 if args.strict and any(t.failed for t in tables) else 0


if __name__ == "__main__":
    sys.exit(main())
