"""The ``xckpt`` command line: inspect, validate, convert, and the subcommands installed packages add
(``xckpt demo``, through the ``xckpt.commands`` entry point)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Sequence

from xckpt import registry
from xckpt.errors import UnsupportedError, XckptError, XckptWarning

_CONVERT_EXAMPLES = """examples:
  xckpt convert --from orbax SRC DST       an Orbax checkpoint to xckpt
  xckpt convert --from dcp SRC DST         a PyTorch DCP checkpoint to xckpt
  xckpt convert --to safetensors --select model --max-shard-size 2GB ckpt/step_1000 hf_model
                                           the "model" subtree as Hugging Face safetensors shards
                                           (then e.g. config.save_pretrained("hf_model"))
"""


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a readable tree of leaves, or JSON."""
    from xckpt.inspect import inspect
    info = inspect(args.path)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    prod = info["producer"]
    fmt = info["format"] + (f" {info['version']}" if info["version"] else "")
    lib = " ".join(str(x) for x in (prod.get("library"), prod.get("library_version")) if x)
    fw = " ".join(str(x) for x in (prod.get("framework"), prod.get("framework_version")) if x)
    print(f"{info['path']}  ({fmt}, written by {' / '.join(x for x in (lib, fw) if x) or 'unknown'})")
    width = max([len(leaf["key"]) for leaf in info["leaves"]] + [4])
    for leaf in info["leaves"]:
        if leaf["kind"] == "array":
            sh = leaf.get("sharding") or {}
            how = ""
            if sh.get("mesh_shape"):
                how = f"mesh {sh['mesh_shape']} {sh.get('dim_axes', '')}"
            elif sh.get("num_shards", 1) > 1:
                how = f"{sh['num_shards']} shards of {sh.get('shard_shape')}"
            print(f"  {leaf['key']:<{width}}  {leaf['dtype']:<9} {str(leaf['shape']):<18} "
                  f"{_fmt_bytes(leaf['bytes']):>10}  {how}")
        else:
            print(f"  {leaf['key']:<{width}}  {leaf['type']:<9} (value)")
    print(f"{info['arrays']} arrays, {info['values']} values, {_fmt_bytes(info['total_bytes'])} of array data")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate; exit 0 when the checkpoint conforms, 1 otherwise."""
    from xckpt.validate import validate
    report = validate(args.path, deep=args.deep)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        for f in report.findings:
            print(str(f))
        state = "OK" if report.ok else "INVALID"
        print(f"{state}: {report.path} ({report.arrays} arrays, {report.chunks} chunk objects"
              + (f", {report.bytes_checked} bytes crc-checked" if args.deep else "") + ")")
    return 0 if report.ok else 1


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert between xckpt and other formats."""
    from xckpt.convert import convert
    given = [flag for flag, v in (("--select", args.select), ("--max-shard-size", args.max_shard_size)) if v is not None]
    if given and args.to_format != "safetensors":
        raise UnsupportedError(f"{' and '.join(given)} apply only to --to safetensors (not --to {args.to_format})",
                               code="convert.option")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", XckptWarning)
        convert(args.src, args.dst, source=args.from_format, target=args.to_format, overwrite=args.overwrite,
                select=args.select, max_shard_size=args.max_shard_size)
    for w in caught:
        if issubclass(w.category, XckptWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    print(f"wrote {args.dst}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """List the leftovers of dead saves under a path and remove the dead ones."""
    from xckpt.gc import gc
    found = gc(args.path, older_than_s=args.older_than, dry_run=args.dry_run)
    if args.json:
        print(json.dumps([c.to_json() for c in found], indent=1))
        return 0
    for c in found:
        x = c.leftover
        state = "dead" if x.stale else "live"
        print(f"{c.action:<13} {x.kind:<6} {state}  unrenewed {x.age_s:9.1f} s  {x.path}")
    removed = sum(c.action in ("removed", "would remove") for c in found)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{len(found)} leftovers, {verb} {removed}, kept {sum(c.action == 'kept' for c in found)} live")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``xckpt`` command."""
    p = argparse.ArgumentParser(prog="xckpt", description="Cross-framework distributed checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("inspect", help="list the leaves of a checkpoint")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("validate", help="check a checkpoint against the spec")
    s.add_argument("path")
    s.add_argument("--deep", action="store_true", help="also verify every chunk's crc32c")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_validate)
    s = sub.add_parser("convert", help="convert a checkpoint between formats", epilog=_CONVERT_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("src")
    s.add_argument("dst")
    formats = registry.converter_formats()
    s.add_argument("--from", dest="from_format", default="xckpt", choices=formats)
    s.add_argument("--to", dest="to_format", default="xckpt", choices=formats)
    s.add_argument("--overwrite", action="store_true")
    s.add_argument("--select", default=None, metavar="SUBTREE",
                   help="--to safetensors: export only the leaves under this key prefix ('model', 'model/encoder'), "
                        "named without it (default: every array leaf)")
    s.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="--to safetensors: bytes per file, e.g. 5GB (default), 200MB, 500KB, 2GiB or a byte count")
    s.set_defaults(fn=cmd_convert)
    s = sub.add_parser("gc", help="remove what dead saves left beside their checkpoints")
    s.add_argument("path", help="a directory or prefix of checkpoints, or one checkpoint's path")
    s.add_argument("--older-than", type=float, default=None, metavar="S",
                   help="dead when unrenewed for S seconds (default: XCKPT_STALE_AFTER_S, else 3600)")
    s.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_gc)
    for command in registry.commands():  # installed packages' subcommands (the demo among them)
        s = sub.add_parser(command.name, help=command.help)
        command.add_arguments(s)
        s.set_defaults(fn=command.run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xckpt`` command."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except XckptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
