"""The ``xckpt`` command line: inspect, validate, convert, ls, diff, gc, and the subcommands installed
packages add (``xckpt demo``, through the ``xckpt.commands`` entry point).

Each command computes with the library and renders here: tables through :mod:`xckpt.cli_render`
(``rich``), progress on stderr only when it is a terminal, and ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any, Sequence

from xckpt import registry
from xckpt.errors import UnsupportedError, XckptError, XckptWarning

_INSPECT_EXAMPLES = """examples:
  xckpt inspect ckpt/step_1000             a table of leaves: dtype, shape, bytes, saved sharding
  xckpt inspect --json ckpt/step_1000      the same as JSON, for scripts
"""

_VALIDATE_EXAMPLES = """examples:
  xckpt validate ckpt/step_1000            metadata and shard indexes; exit 0 when it conforms, 1 if not,
                                           2 when the path cannot be opened (a file, a link loop)
  xckpt validate --deep ckpt/step_1000     also recompute every chunk's crc32c
  xckpt validate --json ckpt/step_1000     the report (findings with their codes) as JSON
"""

_CONVERT_EXAMPLES = """examples:
  xckpt convert --from orbax SRC DST       an Orbax checkpoint to xckpt
  xckpt convert --from dcp SRC DST         a PyTorch DCP checkpoint to xckpt
  xckpt convert --to safetensors --select model --max-shard-size 2GB ckpt/step_1000 hf_model
                                           the "model" subtree as Hugging Face safetensors shards
                                           (then e.g. config.save_pretrained("hf_model"))
  xckpt convert --to safetensors --select model --mapping flax-to-torch --hf-config gpt2/config.json \\
      ckpt/flax_step_1000 hf_model         a flax/optax run under the torch model's names, loadable
                                           by from_pretrained("hf_model")
"""

_LS_EXAMPLES = """examples:
  xckpt ls runs/exp1                       the steps of a run (runs/exp1/<step>/): commit time, size,
                                           leaves, metrics; incomplete steps marked
  xckpt ls ckpts                           without step directories: each checkpoint directly under
                                           ckpts/ (name, format, leaves, size; unreadable ones marked)
  xckpt ls --json runs/exp1                the same as JSON
  xckpt ls --step-format-fixed-length 4 r  a run Orbax wrote with step_format_fixed_length=4 (r/0010/)
"""

_DIFF_EXAMPLES = """examples:
  xckpt diff runs/exp1/1000 runs/exp1/2000       leaves added, removed, or changed in shape, dtype,
                                                 sharding
  xckpt diff --values ckpt_a ckpt_b              also compare the data: per leaf, the count of differing
                                                 elements, max absolute and relative difference
  xckpt diff --values xckpt_ckpt orbax_ckpt      across formats (xckpt, Orbax, safetensors; DCP through
                                                 a temporary xckpt copy)
  xckpt diff --json ckpt_a ckpt_b                the report as JSON

exit status: 0 when the checkpoints hold the same leaves (and, with --values, the same data),
1 when they differ, 2 on error (as diff(1)).
"""

_GC_EXAMPLES = """examples:
  xckpt gc ckpts --dry-run                 list what dead saves left under ckpts/, remove nothing
  xckpt gc ckpts --older-than 600          remove leftovers unrenewed for 10 minutes
"""


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a table of the leaves, or JSON."""
    from xckpt.inspect import inspect
    info = inspect(args.path)
    if args.json:
        _print_json(info)
        return 0
    from xckpt import cli_render as r
    out = r.console()
    prod = info["producer"]
    fmt = info["format"] + (f" {info['version']}" if info["version"] else "")
    lib = " ".join(str(x) for x in (prod.get("library"), prod.get("library_version")) if x)
    fw = " ".join(str(x) for x in (prod.get("framework"), prod.get("framework_version")) if x)
    r.line(out, f"{info['path']}  ({fmt}, written by {' / '.join(x for x in (lib, fw) if x) or 'unknown'})")
    t = r.table("Leaves", "key", "dtype / type", "shape", "size", "sharding", right=("size",))
    for leaf in info["leaves"]:
        if leaf["kind"] == "array":
            t.add_row(leaf["key"], leaf["dtype"], str(leaf["shape"]), r.fmt_bytes(leaf["bytes"]),
                      r.fmt_sharding(leaf.get("sharding")))
        else:
            t.add_row(leaf["key"], leaf["type"], "(value)", "", "")
    r.show(out, t)
    r.line(out, f"{info['arrays']} arrays, {info['values']} values, {r.fmt_bytes(info['total_bytes'])} of array data")
    return 0


def _print_json(obj: Any) -> None:
    """Print ``obj`` as strict JSON, which any parser reads (:func:`xckpt.format.jsonobj.finite`; other objects
    as strings)."""
    from xckpt.format import jsonobj
    # a manifest's free-form members (sharding, metadata) may nest as deep as the parser takes (about 1000
    # levels), and printing walks them recursively, several frames a level
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, _JSON_RECURSION_LIMIT))
    try:
        text = json.dumps(_unicode(jsonobj.finite(obj)), indent=1, default=lambda x: _unicode(str(x)),
                          allow_nan=False)
    finally:
        sys.setrecursionlimit(limit)
    print(text)


#: Recursion limit while :func:`_print_json` runs: enough for the deepest document the JSON parser returns.
_JSON_RECURSION_LIMIT = 10_000


def _unicode(obj: Any) -> Any:
    """``obj`` with every string (dict keys too) valid Unicode: a file name that is not UTF-8, which Python holds
    with lone surrogates (``\\udcff``, which strict JSON parsers refuse), gets its undecodable bytes as ``\\xff``."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return obj.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") \
                if _escapes_only(obj) else obj.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, dict):
        return {_unicode(k): _unicode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_unicode(v) for v in obj]
    return obj


def _escapes_only(text: str) -> bool:
    """Whether the lone surrogates of ``text`` are all ``surrogateescape``'s (undecodable bytes of a file name)."""
    try:
        text.encode("utf-8", "surrogateescape")
        return True
    except UnicodeEncodeError:
        return False


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate; exit 0 when the checkpoint conforms, 1 otherwise (2: nothing at the path)."""
    from xckpt import cli_render as r
    from xckpt.engine.storage import Location
    from xckpt.validate import validate
    loc = Location.of(args.path)
    if loc.is_local:
        try:
            os.stat(loc.local_path)  # through a link (the root may be one): a dangling one opens nothing either
        except FileNotFoundError:
            raise XckptError(f"{args.path}: no such file or directory", code="io.read", file=str(loc)) from None
        except OSError:
            pass  # the store says why (a link loop, a permission)
    with r.spinner(f"validating {args.path}" + (" (every chunk's crc32c)" if args.deep else ""),
                   enabled=args.deep and r.progress_enabled()):
        report = validate(args.path, deep=args.deep)
    args.status = 0 if report.ok else 1  # also when the output is cut short (piped into head)
    if args.json:
        _print_json(report.to_json())
    else:
        out = r.console()
        if report.findings:
            t = r.table("Findings", "severity", "code", "message", "leaf", "file")
            for f in report.findings:
                t.add_row(r.severity(f.severity), f.code, f.message, f.leaf or "", f.file or "")
            r.show(out, t)
        state = "OK" if report.ok else "INVALID"
        r.line(out, f"{state}: {report.path} ({report.arrays} arrays, {report.chunks} chunk objects"
               + (f", {report.bytes_checked} bytes " + ("crc-checked" if report.format == "xckpt" else "read back")
                  if args.deep else "") + ")",
               style="bold green" if report.ok else "bold red")
    return args.status


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert between xckpt and other formats."""
    from xckpt import cli_render as r
    from xckpt.convert import convert
    given = [flag for flag, v in (("--select", args.select), ("--max-shard-size", args.max_shard_size),
                                  ("--mapping", args.mapping), ("--hf-config", args.hf_config)) if v is not None]
    if given and args.to_format != "safetensors":
        raise UnsupportedError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only to --to "
                               f"safetensors (not --to {args.to_format})",
                               code="convert.option")
    config = None if args.hf_config is None else _hf_config_file(args.hf_config)
    mapped = _mapped_export(args, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", XckptWarning)
        with r.spinner(f"converting {args.src} ({args.from_format}) to {args.dst} ({args.to_format})"):
            # the config goes beside the weights, so that from_pretrained loads the export as it is
            convert(args.src, args.dst, source=args.from_format, target=args.to_format, overwrite=args.overwrite,
                    select=args.select, max_shard_size=args.max_shard_size,
                    extra_files=None if config is None else {"config.json": config}, **mapped)
    for w in caught:
        if issubclass(w.category, XckptWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    print(f"wrote {args.dst}")
    return 0


#: ``--mapping`` presets, by name: the functions of :mod:`xckpt.mapping` that make them.
_MAPPINGS = {"flax-to-torch": "flax_to_torch"}


def _hf_config_file(config: str) -> str:
    """The ``config.json`` that ``--hf-config`` names: the file itself, or the one in the directory it names."""
    return os.path.join(config, "config.json") if os.path.isdir(config) else config


def _mapped_export(args: argparse.Namespace, config: str | None) -> dict[str, Any]:
    """The ``mapping`` and ``like`` options of an export renamed for a Hugging Face model (none without
    ``--mapping``): the preset, resolved against the model the ``config.json`` file ``config`` describes,
    under ``--select``."""
    if (args.mapping is None) != (config is None):
        raise UnsupportedError("--mapping and --hf-config go together: the mapping renames the checkpoint for the "
                               "model the configuration describes", code="convert.option")
    if args.mapping is None:
        return {}
    if not args.select:
        raise UnsupportedError("--mapping needs --select: the key the model goes under in the mapped checkpoint "
                               "(model, as a torch training state holds it)", code="convert.option")
    from xckpt import mapping
    build = registry.model_builder("hf")
    if build is None:
        raise UnsupportedError("--hf-config needs torch and transformers installed (pip install xckpt[torch] "
                               "transformers)", code="convert.hf_config")
    assert config is not None
    like: Any = build(config)
    for part in reversed([p for p in args.select.replace("/", ".").split(".") if p]):  # as --select names it
        like = {part: like}
    return {"mapping": getattr(mapping, _MAPPINGS[args.mapping])(), "like": like}


def _positive_int(text: str) -> int:
    """An argument that must be a whole number of 1 or more."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, not {text!r}")
    return n


def _list_checkpoints(root: str) -> list[dict[str, Any]]:
    """Each subdirectory of ``root`` (not a link) as a checkpoint: name, format, leaves, size; unreadable
    ones with their error."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        raise XckptError(f"{root}: no such directory", code="io.read") from None
    except OSError as exc:
        raise XckptError(f"cannot list {root}: {exc.strerror}", code="io.read") from None
    # hidden entries are what saves leave beside their destination
    return [_describe(e.path, e.name) for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]


def _describe(path: str, name: str, *, size_unreadable: bool = True) -> dict[str, Any]:
    """One checkpoint's row of ``xckpt ls``: name, format, leaves, size, or the error that stops reading it.
    The files are walked for the size once it opened (or whatever it is, with ``size_unreadable``)."""
    from xckpt.manager import tree_size
    from xckpt.sources.detect import open_checkpoint
    item: dict[str, Any] = {"name": name, "path": path, "format": None, "leaves": None, "size_bytes": None,
                            "error": None}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            src = open_checkpoint(path)
        try:
            item["format"], item["leaves"] = src.format, len(src.manifest.leaves)
        finally:
            src.close()
    except XckptError as exc:
        item["error"] = {"code": exc.code, "message": exc.message}
    except (OSError, ValueError) as exc:
        item["error"] = {"code": "io.read", "message": str(exc)}
    if item["error"] is None or size_unreadable:
        item["size_bytes"] = tree_size(path)
    return item


def _holds_manifest(path: str) -> bool:
    """Whether ``path`` holds an xckpt manifest or an Orbax item's ``_METADATA`` (it is one checkpoint)."""
    from xckpt.format import names

    return any(os.path.lexists(os.path.join(path, n)) for n in (names.MANIFEST, names.ORBAX_METADATA))


def cmd_ls(args: argparse.Namespace) -> int:
    """List the steps of a run, or the checkpoints in a directory."""
    from dataclasses import asdict

    from xckpt.manager import list_steps
    # a run is not walked as one checkpoint before its steps are (each sized once, by list_steps)
    itself = _describe(str(args.root), os.path.basename(os.path.normpath(str(args.root))), size_unreadable=False)
    if itself["error"] is None or _holds_manifest(str(args.root)):
        # a checkpoint is listed alone (its array folders, "0" and "1" too, are not steps); a damaged one with
        # its error, not its array folders as unreadable checkpoints
        steps, checkpoints = [], [itself]
    else:
        steps = list_steps(args.root, step_format_fixed_length=args.step_format_fixed_length)
        if not any(s.committed for s in steps):  # not a run (numbered exports of another tool, say): its checkpoints
            steps = []
        checkpoints = [] if steps else _list_checkpoints(str(args.root))
    if args.json:
        _print_json({"root": str(args.root), "steps": [asdict(s) for s in steps], "checkpoints": checkpoints})
        return 0
    from xckpt import cli_render as r
    out = r.console()
    if steps:
        with_metrics = any(s.metrics for s in steps)
        cols = ["step", "status", "committed at", "size", "leaves", "format"] + (["metrics"] if with_metrics else [])
        t = r.table(f"Steps of {args.root}", *cols, right=("step", "size", "leaves"))
        for s in steps:
            status = r.styled("committed", "green") if s.committed else r.styled("incomplete", "bold red")
            row = [str(s.step), status, r.fmt_time(s.commit_time), r.fmt_bytes(s.size_bytes),
                   "-" if s.leaves is None else str(s.leaves), s.format or "-"]
            if with_metrics:
                row.append(", ".join(f"{k}={r.fmt_number(v)}" for k, v in s.metrics.items()))
            t.add_row(*row)
        r.show(out, t)
        bad = sum(not s.committed for s in steps)
        r.line(out, f"{len(steps)} steps, {len(steps) - bad} committed, {bad} incomplete"
               + (f", latest committed: {max(s.step for s in steps if s.committed)}" if bad < len(steps) else ""))
        return 0
    t = r.table(f"Checkpoints in {args.root}", "name", "status", "format", "leaves", "size", right=("leaves", "size"))
    for c in checkpoints:
        err = c["error"]
        status = r.styled("ok", "green") if err is None else r.styled(f"unreadable ({err['code']})", "bold red")
        t.add_row(c["name"], status, c["format"] or "-", "-" if c["leaves"] is None else str(c["leaves"]),
                  r.fmt_bytes(c["size_bytes"]))
    r.show(out, t)
    bad = sum(c["error"] is not None for c in checkpoints)
    r.line(out, f"no steps under {args.root}; {len(checkpoints)} directories, {len(checkpoints) - bad} checkpoints"
           + (f", {bad} unreadable" if bad else ""))
    return 0


def _leaf_what(d: dict[str, Any]) -> tuple[str, str]:
    """(dtype or value type, shape) of a leaf as :func:`xckpt.diff.diff` describes it."""
    if d["kind"] == "array":
        return d["dtype"], str(d["shape"])
    return d["type"], "(value)"


def _change_text(item: dict[str, Any], side: str) -> str:
    """What a changed leaf is on ``side`` ("a" or "b"), for the attributes that changed."""
    from xckpt import cli_render as r
    d = item[side]
    parts = []
    for what in item["changes"]:
        if what == "kind":
            parts.append(d["kind"])
        elif what == "sharding":
            parts.append("sharding " + r.fmt_sharding(d.get("sharding"), full=True))
        else:
            parts.append(str(d.get(what)))
    return ", ".join(parts)


def cmd_diff(args: argparse.Namespace) -> int:
    """Compare two checkpoints; exit 0 when they are the same, 1 when they differ."""
    from xckpt import cli_render as r
    from xckpt.diff import diff
    with r.progress_bar("comparing values", enabled=args.values and r.progress_enabled()) as update:
        report = diff(args.a, args.b, values=args.values, progress=update)
    args.status = 0 if report["identical"] else 1  # also when the output is cut short (piped into head)
    if args.json:
        _print_json(report)
        return args.status
    out = r.console()
    for side in ("a", "b"):
        s = report[side]
        r.line(out, f"{side.upper()}: {s['path']}  ({s['format']}, {s['leaves']} leaves, "
               f"{r.fmt_bytes(s['bytes'])} of array data)")
    for title, items, style in ((f"Added (only in B): {len(report['added'])}", report["added"], "green"),
                                (f"Removed (only in A): {len(report['removed'])}", report["removed"], "red")):
        if items:
            t = r.table(title, "key", "dtype / type", "shape", "sharding")
            for d in items:
                t.add_row(r.styled(d["key"], style), *_leaf_what(d), r.fmt_sharding(d.get("sharding")))
            r.show(out, t)
    if report["changed"]:
        t = r.table(f"Changed: {len(report['changed'])}", "key", "what", "A", "B")
        for item in report["changed"]:
            t.add_row(r.styled(item["key"], "yellow"), ", ".join(item["changes"]), _change_text(item, "a"),
                      _change_text(item, "b"))
        r.show(out, t)
    vals = report["values"]
    if vals is not None:
        arrays = [v for v in vals["leaves"] if not v["equal"] and v["kind"] == "array"]
        values = [v for v in vals["leaves"] if not v["equal"] and v["kind"] == "value"]
        if arrays:
            t = r.table(f"Differing arrays: {len(arrays)}", "key", "dtype", "elements", "differing",
                        "max abs diff", "max rel diff", right=("elements", "differing", "max abs diff", "max rel diff"))
            for v in arrays:
                dt = v["dtype"] if isinstance(v["dtype"], str) else " / ".join(v["dtype"])
                t.add_row(r.styled(v["key"], "yellow"), dt, str(v["elements"]), str(v["differing"]),
                          r.fmt_number(v["max_abs_diff"]), r.fmt_number(v["max_rel_diff"]))
            r.show(out, t)
        if values:
            t = r.table(f"Differing values: {len(values)}", "key", "A", "B")
            for v in values:
                t.add_row(r.styled(v["key"], "yellow"), v["a"], v["b"])
            r.show(out, t)
        if vals["skipped"]:
            t = r.table(f"Not compared: {len(vals['skipped'])}", "key", "why")
            for v in vals["skipped"]:
                t.add_row(v["key"], v["reason"])
            r.show(out, t)
    summary = (f"{len(report['added'])} added, {len(report['removed'])} removed, {len(report['changed'])} changed, "
               f"{report['unchanged']} unchanged")
    if vals is not None:
        summary += (f"; values: {vals['differing']} of {vals['compared']} leaves compared differ "
                    f"({r.fmt_bytes(vals['bytes_read'])} read)")
    r.line(out, ("identical: " if report["identical"] else "different: ") + summary,
           style="bold green" if report["identical"] else "bold yellow")
    return args.status


def cmd_gc(args: argparse.Namespace) -> int:
    """List the leftovers of dead saves under a path and remove the dead ones."""
    from xckpt.gc import gc
    found = gc(args.path, older_than_s=args.older_than, dry_run=args.dry_run)
    failed = [c for c in found if c.action == "failed"]
    args.status = 2 if failed else 0
    if args.json:
        _print_json([c.to_json() for c in found])
        return args.status
    for c in found:
        x = c.leftover
        state = "dead" if x.stale else "live"
        print(f"{c.action:<13} {x.kind:<6} {state}  unrenewed {x.age_s:9.1f} s  {x.path}"
              + (f"  ({c.error})" if c.error else ""))
    removed = sum(c.action in ("removed", "would remove") for c in found)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{len(found)} leftovers, {verb} {removed}, kept {sum(c.action == 'kept' for c in found)} live"
          + (f", {len(failed)} could not be removed" if failed else ""))
    return args.status


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``xckpt`` command."""
    p = argparse.ArgumentParser(prog="xckpt", description="Cross-framework distributed checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help: str, examples: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", epilog=examples,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    s = add("inspect", "list the leaves of a checkpoint", _INSPECT_EXAMPLES)
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(fn=cmd_inspect)
    s = add("validate", "check a checkpoint against the spec", _VALIDATE_EXAMPLES)
    s.add_argument("path")
    s.add_argument("--deep", action="store_true", help="also verify every chunk's crc32c")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(fn=cmd_validate)
    s = add("convert", "convert a checkpoint between formats", _CONVERT_EXAMPLES)
    s.add_argument("src")
    s.add_argument("dst")
    formats = registry.converter_formats()
    s.add_argument("--from", dest="from_format", default="xckpt", choices=formats,
                   help="the format of SRC (default xckpt)")
    s.add_argument("--to", dest="to_format", default="xckpt", choices=formats,
                   help="the format to write DST in (default xckpt; not every pair converts: an unsupported one "
                        "lists those that do)")
    s.add_argument("--overwrite", action="store_true", help="replace DST when it is a checkpoint of that format")
    s.add_argument("--select", default=None, metavar="SUBTREE",
                   help="--to safetensors: export only the leaves under this key prefix ('model', 'model/encoder'), "
                        "named without it (default: every array leaf)")
    s.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="--to safetensors: bytes per file, e.g. 5GB (default), 200MB, 500KB, 2GiB or a byte count")
    s.add_argument("--mapping", default=None, choices=sorted(_MAPPINGS),
                   help="--to safetensors: rename and lay out the arrays for the model of --hf-config "
                        "(flax-to-torch: a flax/optax checkpoint exported under the torch model's names)")
    s.add_argument("--hf-config", default=None, metavar="CONFIG",
                   help="--to safetensors with --mapping: the Hugging Face config.json (or a directory holding "
                        "one) of the model to export for; it is copied beside the weights")
    s.set_defaults(fn=cmd_convert)
    s = add("ls", "list the steps of a run, or the checkpoints in a directory", _LS_EXAMPLES)
    s.add_argument("root", help="a run's directory (one subdirectory per step) or a directory of checkpoints")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--step-format-fixed-length", type=_positive_int, metavar="N",
                   help="step directories are zero-padded to N digits (Orbax's option of that name: 0010 is step 10)")
    s.set_defaults(fn=cmd_ls)
    s = add("diff", "compare two checkpoints leaf by leaf", _DIFF_EXAMPLES)
    s.add_argument("a", help="the first checkpoint (xckpt, Orbax, safetensors or DCP)")
    s.add_argument("b", help="the second checkpoint")
    s.add_argument("--values", action="store_true",
                   help="also compare the data of the leaves both hold (streamed, in pieces of bounded size)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(fn=cmd_diff)
    s = add("gc", "remove what dead saves left beside their checkpoints", _GC_EXAMPLES)
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
        text = str(exc)
        if hasattr(args, "overwrite"):  # the API's keyword, as the command line spells it
            text = text.replace("overwrite=True", "--overwrite")
        print(f"error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`: the command's verdict still stands
        sys.stderr.close()
        return getattr(args, "status", 0)
    except OSError as exc:  # the file system refused (a link loop, a permission, a file where a folder was asked)
        print(f"error: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
