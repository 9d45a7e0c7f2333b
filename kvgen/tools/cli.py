"""The `kvgen` command line: build, check, validate, list, explain, verify, detect, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgen import __version__
from kvgen.emit.build import build, check
from kvgen.errors import KVGenError, SpecError, display_path
from kvgen.oracle.address import explain_lines, symbolic_address
from kvgen.plan.kernel import kernel_grid
from kvgen.plan.package import plan_connectors as plan_library
from kvgen.plan.program import program_plan
from kvgen.spec.describe import format2_facts
from kvgen.spec.library import BUILTIN_SPECS
from kvgen.spec.models import model_facts
from kvgen.spec.transfers import load_transfers
from kvgen.tools.backends import backend_line as _backend_line
from kvgen.tools.backends import backends as _backends
from kvgen.tools.bench import add_arguments as add_bench_arguments
from kvgen.tools.bench import main as bench_main
from kvgen.tools.detect_view import add_arguments as add_detect_arguments
from kvgen.tools.detect_view import detect_main
from kvgen.tools.models_view import explain_model, model_connectors, print_models
from kvgen.tools.paths import (
    DefaultOut,
    default_out,
    describe_default_out,
    rebuild_advice,
    refuse_foreign_out,
    refuse_package_out,
    temporary_build,
)
from kvgen.tools.pd import command as pd
from kvgen.tools.specset import load_lenient, twin_warnings, validate
from kvgen.tools.verify.run import main as verify_main
from kvgen.tp import explain

#: Exit statuses: bad input, Ctrl-C (128 + SIGINT), a closed output pipe (128 + SIGPIPE, as a
#: C tool killed by SIGPIPE shows in the shell), a bug in kvgen.
EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PIPE, EXIT_BUG = 1, 130, 141, 70


def _specs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--specs", action="append", type=Path, default=[], metavar="DIR",
                   help="a folder of spec files (or one file) to add to the built-in specs; repeatable")


def _tp_sizes(text: str) -> tuple[int, int]:
    """`2:8` -> (2, 8)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--tp takes SRC:DST, two positive TP sizes such as 2:8, got {text!r}")
    return int(parts[0]), int(parts[1])


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _out_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--out", type=Path, default=DefaultOut(default_out()), metavar="DIR",
                   help=f"{what} ({describe_default_out()})")


def _warn_left_out(loaded: Any) -> None:
    """Problems of user spec files that explain/list left out, as warnings on stderr."""
    if not loaded.problems:
        return
    for problem in loaded.problems:
        print(f"warning: {problem}", file=sys.stderr)
    n = len(loaded.left_out)
    print(f"kvgen: warning: left out {n} spec file{'s' if n != 1 else ''} with problems: "
          f"{', '.join(loaded.left_out)} (`kvgen validate` lists them; `kvgen build` refuses them)",
          file=sys.stderr)


def _require(paths: Sequence[Path], what: str) -> None:
    """Missing inputs, said plainly before any work."""
    for path in paths:
        if not os.path.lexists(path):  # a dangling or looping symlink is there, and said what it is later
            raise KVGenError(f"{what} {display_path(path)}: no such file or folder")


def cmd_build(args: argparse.Namespace) -> int:
    _require(args.specs, "--specs")
    refuse_package_out(args.out)
    refuse_foreign_out(args.out)
    files = build(args.out, args.specs)
    print(f"wrote {len(files)} files to {display_path(args.out)}")
    if args.specs:
        for warning in twin_warnings(args.specs):
            print(f"warning: {warning}", file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    _require(args.specs, "--specs")
    report = check(args.out, args.specs)
    if report.ok:
        print(f"{display_path(args.out)} is up to date")
        return 0
    for line in report.lines():
        print(line, file=sys.stderr)
    print(f"kvgen: {display_path(args.out)} differs from what `kvgen build` writes; "
          f"{rebuild_advice(args.out, args.specs)}", file=sys.stderr)
    return EXIT_FAILED


def cmd_validate(args: argparse.Namespace) -> int:
    _require(args.paths, "spec")
    result = validate(args.paths)
    if not result.files:
        raise KVGenError(f"no spec files (*.yaml, *.yml) in {', '.join(map(display_path, args.paths))}")
    for spec in result.ok:
        print(f"ok  {spec.source}: {spec.name} ({spec.kind}) {spec.arrow()}")
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if result.problems:
        raise SpecError(result.problems)
    return 0


def _connectors(spec: Any, plans: list[Any]) -> str:
    """The connectors column: a layout's objects, or how many layouts an object pairs with."""
    if spec.is_paged:
        return ", ".join(p.obj.name + (" (layerwise)" if p.mode == "layerwise" else "")
                         for p in plans if p.paged is spec) or "-"
    n = sum(1 for p in plans if p.obj is spec)
    return f"{n} layout{'s' if n != 1 else ''}"


def _spec_facts(s: Any, plans: list[Any]) -> dict[str, Any]:
    """One spec's entry in `kvgen list --json`."""
    facts = {"kind": s.kind, "summary": s.summary, "lists": list(s.lists),
             "dims": [list(d.axes) if d.is_fused else (d.axes[0] if d.axes else 1) for d in s.dims],
             "sizes": dict(s.sizes), "arrow": s.arrow(), "aliases": list(s.aliases),
             "planes": s.planes, "source": s.origin}
    if s.is_paged:
        facts.update(lmcache=s.lmcache_format, engines=list(s.engines), versions=dict(s.versions),
                     connectors=[p.obj.name for p in plans if p.paged is s])
    else:
        facts.update(format=s.format, code=s.code, accepts=list(s.accepts))
    if not s.is_simple:
        facts.update(format2_facts(s))
    return facts


def _list_json(library: Any, plans: list[Any]) -> None:
    pairs = [{"paged": p.paged.name, "object": p.obj.name, "mode": p.mode, "module": p.module,
              "strategy": p.strategy, "kernel": kernel_grid(p), "cpu_kernel": _cpu_kernel(p)} for p in plans]
    json.dump({"kvgen": __version__, "layouts": {s.name: _spec_facts(s, plans) for s in library.specs},
               "connectors": pairs, "backends": _backends(),
               "models": {m.name: model_facts(m) for m in library.models}}, sys.stdout, indent=2)
    print()


def _list_table(library: Any, plans: list[Any]) -> None:
    header = ("NAME", "KIND", "ALIASES", "LAYOUT", "LMCACHE/FORMAT", "CONNECTORS")
    rows = [(s.name, s.kind, ", ".join(s.aliases) or "-", s.arrow(),
             (s.lmcache_format or "-") if s.is_paged else f"{s.format} ({s.code})", _connectors(s, plans))
            for s in library.specs]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
    print_models(library)
    print(f"\n{len(library.paged)} paged layouts, {len(library.objects)} memory objects, {len(library.models)} "
          f"model{'s' if len(library.models) != 1 else ''}, {len(plans)} connectors (module names: LAYOUT__OBJECT)")
    print(_backend_line())


def cmd_list(args: argparse.Namespace) -> int:
    _require(args.specs, "--specs")
    loaded = load_lenient(args.specs)
    _warn_left_out(loaded)
    library = loaded.library
    plans = plan_library(library)
    (_list_json if args.json else _list_table)(library, plans)
    # Like ls with a missing file: what could be read is listed, the status says it is not all.
    return EXIT_FAILED if loaded.left_out else 0


def _explain_header(spec: Any) -> None:
    """A spec's summary, layout, element address and source."""
    coord = "(l, kv, slot, h, c)" if spec.is_paged else "(l, kv, t, h, c)"
    print(f"{spec.name} ({spec.kind}): {spec.summary}")
    print(f"  layout:   {spec.arrow()}")
    if spec.given:
        print(f"  given:    [{' '.join(d.render() for d in spec.given)}] (the order the engine hands leaves over in)")
    if spec.is_simple:
        print(f"  element {coord}: {symbolic_address(spec)}")
    for line in explain_lines(spec):
        print(line)
    print(f"  aliases:  {', '.join(spec.aliases) or '-'}")
    print(f"  source:   {_spec_file(spec)}")
    if spec.is_paged:
        print(f"  lmcache:  {spec.lmcache_format or '- (no LMCache connector)'}")
        print(f"  engines:  {', '.join(spec.engines) or '-'}")
        if spec.versions:
            print(f"  versions: {', '.join(f'{family} {span}' for family, span in spec.versions)}")
    else:
        print(f"  format:   {spec.format} (code {spec.code}), accepts {', '.join(spec.accepts) or '-'}")


def _explain_connectors(spec: Any, library: Any) -> None:
    plans = [p for p in plan_library(library) if spec in (p.paged, p.obj)]
    if plans:
        print("  connectors:")
        for p in plans:
            print(f"    {p.module} ({p.mode}): {p.strategy}")
            grid = kernel_grid(p)
            print(f"      triton kernel: {grid}")
            print(f"      cpu kernel:    {_cpu_kernel(p)}")
        print(f"  {_backend_line(refused=any(program_plan(p).compiled is not None for p in plans))}")


def _cpu_kernel(plan: Any) -> str:
    """What the compiled CPU kernel does with a connector, from its PROGRAM."""
    program = program_plan(plan)
    if program.compiled is not None:
        return f"none: {program.compiled}"
    split = [dict(q.fields)["slot_split"] for q in program.planes if "slot_split" in dict(q.fields)]
    return "compiled" + (f" (block slots split as {', '.join(' x '.join(s) for s in sorted(set(split)))})"
                         if split else "")


def cmd_explain(args: argparse.Namespace) -> int:
    _require(args.specs, "--specs")
    loaded = load_lenient(args.specs)
    _warn_left_out(loaded)
    library = loaded.library
    if any(m.name == args.name.lower() for m in library.models):
        model = library.model(args.name)
        print("\n".join(explain_model(model, library, model_connectors(model, library))))
        return 0
    try:
        spec = library[args.name]
    except KVGenError as exc:
        if loaded.left_out:
            raise KVGenError(f"{exc}; it may be in a spec file left out for its problems: "
                             f"{', '.join(loaded.left_out)}") from None
        raise
    tp_lines = _tp_plan(spec, args)  # an impossible --tp fails before anything is printed
    _explain_header(spec)
    _explain_connectors(spec, library)
    _explain_transfers(spec, library, args)
    if tp_lines is not None:
        print()
        print("\n".join(tp_lines))
    return 0


def _spec_file(spec: Any) -> str:
    """Where the spec file is, as the user can open it: a built-in's under the installed (or
    checked-out) kvgen's specs/, a user's as given."""
    source, builtin = Path(spec.source), BUILTIN_SPECS.parent / spec.origin
    return display_path(source if source.is_file() or not builtin.is_file() else builtin)


def _explain_transfers(spec: Any, library: Any, args: argparse.Namespace) -> None:
    """The layout's declared transfers."""
    if spec.is_paged:
        try:
            moves = [t for t in load_transfers(library, args.specs) if spec in (t.src, t.dst)]
        except SpecError:
            moves = []  # `kvgen build` reports a broken transfers file; explain shows the layout
        if moves:
            print("  transfers:")
            for t in moves:
                print(f"    {t.src.name} -> {t.dst.name} ({t.module}, declared at {t.declared})")


def _tp_plan(spec: Any, args: argparse.Namespace) -> list[str] | None:
    """With --tp, the resharding plan in words (kvgen.tp); None without it."""
    if args.tp is None:
        return None
    if not spec.is_paged:
        raise KVGenError(f"--tp plans a resharding of paged caches; {spec.name} is a memory object")
    src_tp, dst_tp = args.tp
    return list(explain(args.kv_heads, src_tp, dst_tp, mla=not spec.has("H")))


def cmd_verify(args: argparse.Namespace) -> int:
    _require(args.specs, "--specs")
    if not args.specs or not isinstance(args.out, DefaultOut):
        return verify_main(args)
    with temporary_build(args.specs) as args.out:  # a user's specs: no build of their own needed first
        return verify_main(args)


def cmd_detect(args: argparse.Namespace) -> int:
    return detect_main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    return bench_main(args)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvgen", description=__doc__)
    ap.add_argument("--version", action="version", version=f"kvgen {__version__}",
                    help="print kvgen's version and exit")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("build", help="generate connectors and format tables from the specs")
    _specs_arg(p)
    _out_arg(p, "folder to write the generated package to, replacing it whole")
    p.set_defaults(run=cmd_build)

    p = sub.add_parser("check", help="exit 1 when the output differs from what build would write")
    _specs_arg(p)
    _out_arg(p, "generated package to compare")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("validate", help="check spec files as build does (against the built-ins too) "
                                        "and report every problem")
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                   help="a spec file, or a folder of them (*.yaml, *.yml, searched recursively)")
    p.set_defaults(run=cmd_validate)

    p = sub.add_parser("list", help="list layouts, memory objects and their connectors")
    _specs_arg(p)
    p.add_argument("--json", action="store_true", help="print every fact as JSON instead of a table")
    p.set_defaults(run=cmd_list)

    p = sub.add_parser("explain", help="how a layout addresses an element, and its connectors")
    _specs_arg(p)
    p.add_argument("name", help="layout or object: a name, an alias (any case), or an LMCache format name")
    p.add_argument("--tp", type=_tp_sizes, default=None, metavar="SRC:DST",
                   help="print the TP resharding plan from SRC ranks to DST ranks (head ranges per rank pair)")
    p.add_argument("--kv-heads", type=int, default=8, metavar="N",
                   help="the model's total KV heads, for --tp (default: 8; MLA layouts ignore it)")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser("verify", help="run every connector of a generated package against the reference")
    _specs_arg(p)
    _out_arg(p, "generated package to verify; it must hold exactly the connectors of the built-in specs plus "
                "--specs (with --specs and no --out: those, built into a temporary folder)")
    p.add_argument("--device", action="append", default=None, metavar="TYPE",
                   help="device type to run on, e.g. cpu or cuda; repeatable (default: every one present)")
    p.add_argument("--only", default=None, metavar="TEXT",
                   help="run only the connectors whose module name (LAYOUT__OBJECT) contains TEXT (and no fact "
                        "or engine checks of the built-in specs, which a whole verify runs)")
    p.add_argument("--backend", choices=("triton", "torch"), default=None,
                   help="force how connectors move data: the generated Triton kernels (on the CPU through "
                        "Triton's interpreter, TRITON_INTERPRET=1, set here) or the torch ops (default: each "
                        "connector's own choice)")
    p.add_argument("--jobs", type=_positive_int, default=None, metavar="N",
                   help="check rows in N worker processes (default: one per core, at most 4 and one per 8 GiB "
                        "of memory; 1: in this process)")
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("detect", help="which layout a cache of this shape is (refuses to guess)")
    _specs_arg(p)
    add_detect_arguments(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=cmd_detect)

    p = sub.add_parser("pd", help="move a request between prefill and decode processes through NIXL, and check it")
    pd.add_arguments(p)
    p.set_defaults(run=pd.main)

    p = sub.add_parser("bench", help="measure store/load bandwidth against memcpy and a naive connector")
    add_bench_arguments(p)
    p.set_defaults(run=cmd_bench)
    return ap


def _report(exc: BaseException) -> None:
    if isinstance(exc, SpecError):
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        n = len(exc.problems)
        print(f"kvgen: {n} problem{'s' if n != 1 else ''} in specs", file=sys.stderr)
    elif isinstance(exc, OSError) and exc.filename is not None:
        print(f"kvgen: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
    else:
        print(f"kvgen: {exc}", file=sys.stderr)


def _silence_stdout() -> None:
    """After a broken pipe: send what is still buffered, and the interpreter's last flush, nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status. Bad input is a message on stderr, never a
    traceback (set KVGEN_TRACEBACK=1 to see one for a bug in kvgen)."""
    try:
        try:
            args = parser().parse_args(argv)
        except SystemExit:  # --help, --version, a usage error: their output meets the pipe here
            sys.stdout.flush()
            raise
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE
    except KeyboardInterrupt:
        print("kvgen: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (KVGenError, OSError) as exc:
        _report(exc)
        return EXIT_FAILED
    except Exception as exc:
        if os.environ.get("KVGEN_TRACEBACK"):
            raise
        print(f"kvgen: internal error, please report it: {type(exc).__name__}: {exc} "
              "(KVGEN_TRACEBACK=1 shows where)", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
