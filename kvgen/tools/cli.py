"""The `kvgen` command line: build, check, validate, list, explain, verify, bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgen import __version__
from kvgen.errors import BuildError, SpecError


def _specs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--specs", action="append", type=Path, default=[], metavar="DIR",
                   help="extra spec folder or file (repeatable); the built-in specs are always included")


def cmd_build(args: argparse.Namespace) -> int:
    from kvgen.emit.build import build

    files = build(args.out, args.specs)
    print(f"wrote {len(files)} files to {args.out}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from kvgen.emit.build import check

    report = check(args.out, args.specs)
    if report.ok:
        print(f"{args.out} is up to date")
        return 0
    for line in report.lines():
        print(line, file=sys.stderr)
    print("run `kvgen build` (and commit generated/)", file=sys.stderr)
    return 1


def cmd_validate(args: argparse.Namespace) -> int:
    from kvgen.spec.library import load_specs
    from kvgen.spec.passes import check_library

    entries = load_specs([(f, f.name) for f in args.files])
    problems = check_library(entries)
    if problems:
        raise SpecError(problems)
    for spec, _ in entries:
        print(f"ok  {spec.source}: {spec.name} ({spec.kind}) {spec.arrow()}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from kvgen.plan.copy import plan_library
    from kvgen.spec.library import load_library

    library = load_library(args.specs)
    plans = plan_library(library)
    if args.json:
        layouts = {}
        for s in library.specs:
            facts = {"kind": s.kind, "summary": s.summary, "lists": list(s.lists),
                     "dims": [list(d.axes) if d.is_fused else (d.axes[0] if d.axes else 1) for d in s.dims],
                     "sizes": dict(s.sizes), "arrow": s.arrow(), "aliases": list(s.aliases),
                     "planes": s.planes, "source": s.origin}
            if s.is_paged:
                facts.update(lmcache=s.lmcache_format, engines=list(s.engines),
                             connectors=[p.obj.name for p in plans if p.paged is s])
            else:
                facts.update(format=s.format, code=s.code, accepts=list(s.accepts))
            layouts[s.name] = facts
        pairs = [{"paged": p.paged.name, "object": p.obj.name, "mode": p.mode, "module": p.module,
                  "strategy": p.strategy} for p in plans]
        json.dump({"kvgen": __version__, "layouts": layouts, "connectors": pairs}, sys.stdout, indent=2)
        print()
        return 0
    width = max(len(s.name) for s in library.specs)
    for s in library.specs:
        extra = s.lmcache_format or "-" if s.is_paged else f"{s.format} ({s.code})"
        print(f"{s.name:<{width}}  {s.kind:<6}  {s.arrow():<28}  {extra}")
    print(f"\n{len(library.paged)} paged layouts, {len(library.objects)} objects, {len(plans)} connectors")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from kvgen.oracle.address import symbolic_address
    from kvgen.plan.copy import plan_library
    from kvgen.spec.library import load_library

    library = load_library(args.specs)
    try:
        spec = library[args.name]
    except KeyError as exc:
        print(f"kvgen: {exc.args[0]}", file=sys.stderr)
        return 1
    coord = "(l, kv, slot, h, c)" if spec.is_paged else "(l, kv, t, h, c)"
    print(f"{spec.name} ({spec.kind}): {spec.summary}")
    print(f"  layout:   {spec.arrow()}")
    print(f"  element {coord}: {symbolic_address(spec)}")
    print(f"  aliases:  {', '.join(spec.aliases) or '-'}")
    if spec.is_paged:
        print(f"  lmcache:  {spec.lmcache_format or '- (no LMCache connector)'}")
        print(f"  engines:  {', '.join(spec.engines) or '-'}")
    else:
        print(f"  format:   {spec.format} (code {spec.code}), accepts {', '.join(spec.accepts) or '-'}")
    plans = [p for p in plan_library(library) if spec in (p.paged, p.obj)]
    if plans:
        print("  connectors:")
        for p in plans:
            print(f"    {p.module} ({p.mode}): {p.strategy}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from kvgen.tools.verify import main as verify_main

    return verify_main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvgen.tools.bench import main as bench_main

    return bench_main(args)


def parser() -> argparse.ArgumentParser:
    from kvgen.emit.build import DEFAULT_OUT

    ap = argparse.ArgumentParser(prog="kvgen", description=__doc__)
    ap.add_argument("--version", action="version", version=f"kvgen {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", help="generate connectors and format tables")
    _specs_arg(p)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: generated/)")
    p.set_defaults(run=cmd_build)

    p = sub.add_parser("check", help="exit 1 when the output differs from what build would write")
    _specs_arg(p)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("validate", help="check spec files and report every problem")
    p.add_argument("files", nargs="+", type=Path)
    p.set_defaults(run=cmd_validate)

    p = sub.add_parser("list", help="list layouts, objects and connectors")
    _specs_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_list)

    p = sub.add_parser("explain", help="how a layout addresses an element, and its connectors")
    _specs_arg(p)
    p.add_argument("name", help="layout name or alias")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser("verify", help="run every generated connector against the reference")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="generated package to verify")
    p.add_argument("--device", action="append", default=None, help="device type (default: all present)")
    p.add_argument("--only", default=None, help="substring of connector module names to run")
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("bench", help="measure store/load bandwidth against memcpy and a naive connector")
    from kvgen.tools.bench import add_arguments

    add_arguments(p)
    p.set_defaults(run=cmd_bench)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except SpecError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        n = len(exc.problems)
        print(f"kvgen: {n} problem{'s' if n != 1 else ''} in specs", file=sys.stderr)
        return 1
    except (BuildError, FileNotFoundError) as exc:
        print(f"kvgen: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
