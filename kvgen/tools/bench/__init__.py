"""`kvgen bench`: store/load bandwidth of generated connectors, side by side with a plain
copy of the same bytes and a naive connector, plus the per-call cost of input checks.

For every selected (paged layout, memory object) connector and token count, one row per
direction (store = from_gpu, load = to_gpu) reports GB/s (bytes of KV moved / median
seconds) of the connector, of a flat `dst.copy_(src)` of the same byte count (memcpy) and
of a naive connector. The three contenders run in a rotated order on every repeat, and the
ratios are taken per repeat (paired) and shown as min-median-max; a row whose memcpy
baseline varied by more than 25% is flagged. Before timing, each row checks once that the
naive baseline and the connector leave identical bits.

The package by job:
  targets   which connectors (built-ins plus --specs folders) and on what inputs
  baseline  the memcpy and naive contenders
  measure   rotated, paired timing and spreads (pure Python)
  run       one run: caches, agreement checks, timings, check costs
  report    tables, JSON
  goals     the speed targets, judged on the run's own figures
  plot      GB/s and x memcpy against tokens per chunk (--plot)
This module holds the command line; it imports no torch, as `kvgen build` loads it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgen.errors import KVGenError, SpecError
from kvgen.spec.library import load_library
from kvgen.tools.bench import goals
from kvgen.tools.bench.busy import neighbour
from kvgen.tools.bench.plot import SWEEP_TOKENS, draw
from kvgen.tools.bench.targets import DEFAULT_LAYOUTS, DEFAULT_OBJECTS, DEFAULT_TOKENS, MLA_C, every_builtin

#: Default transfer rows (kept here too: this module imports no torch).
DEFAULT_TRANSFERS = ("vllm_flash_attn_hnd:vllm_flash_attn_nhd", "vllm_flash_attn_nhd:hicache_page_first")
DEFAULT_MODELS = ("gpt_oss_120b", "qwen3_next_80b_a3b")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _tokens(text: str) -> list[int]:
    try:
        values = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes a comma list of integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--tokens must be positive integers, got {text!r}")
    return values


def _backends(text: str) -> list[str]:
    values = _csv(text)
    wrong = [v for v in values if v not in ("auto", "native", "torch", "triton")]
    if not values or wrong:
        raise argparse.ArgumentTypeError(f"--backend takes a comma list of auto, native, torch, triton; got {text!r}")
    return list(dict.fromkeys(values))


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--specs", action="append", type=Path, default=[], metavar="DIR",
                   help="extra spec folder or file (repeatable), added to the built-in specs so that "
                        "--layouts can name user layouts; their connectors are built for this run")
    p.add_argument("--layouts", type=_csv, default=list(DEFAULT_LAYOUTS), metavar="A,B",
                   help="paged layouts (names or aliases); default: " + ",".join(DEFAULT_LAYOUTS))
    p.add_argument("--objects", type=_csv, default=list(DEFAULT_OBJECTS), metavar="A,B",
                   help="memory objects; each layout is paired with those it has a connector for "
                        "(default: " + ",".join(DEFAULT_OBJECTS) + ")")
    p.add_argument("--transfers", default=",".join(DEFAULT_TRANSFERS), metavar="SRC:DST,...",
                   help="layout-to-layout transfers to measure against memcpy and the two-copy path (store into "
                        "an object, load from it), or 'none' (default: " + ",".join(DEFAULT_TRANSFERS) + ")")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), metavar="MODEL,...",
                   help="model specs whose kv_groups connector to measure (each group with its own block table, "
                        "a request's state) against memcpy and the per-group path, at the model's own geometry, "
                        "or 'none' (default: " + ",".join(DEFAULT_MODELS) + ")")
    p.add_argument("-L", "--layers", type=_positive, default=32, help="layers of the cache (default: 32)")
    p.add_argument("--heads", type=_positive, default=8, help="KV heads (ignored by MLA layouts; default: 8)")
    p.add_argument("--head-size", type=_positive, default=128,
                   help=f"head size (MLA layouts use C = {MLA_C}; default: 128)")
    p.add_argument("--block-size", type=_positive, default=16, help="slots per block, N (default: 16)")
    p.add_argument("--tokens", type=_tokens, default=None, metavar="T,T",
                   help="tokens per chunk, comma list (default: " + ",".join(map(str, DEFAULT_TOKENS)) +
                        "; with --plot " + ",".join(map(str, SWEEP_TOKENS)) +
                        "; 8192 is 1 GiB per object at the default geometry)")
    p.add_argument("--dtype", default="bfloat16", help="element type of caches and objects (default: bfloat16)")
    p.add_argument("--alloc", choices=("contiguous", "random"), default="random",
                   help="block allocation of the chunk: in order from block 0, or blocks in random order")
    p.add_argument("--device", default="cpu", help="device of caches and objects (default: cpu)")
    p.add_argument("--warmup", type=_nonnegative, default=2, help="untimed runs of each contender (default: 2)")
    p.add_argument("--repeats", type=_positive, default=5,
                   help="timed repeats, contenders in rotated order; GB/s from the median, ratios min-median-max "
                        "(default: 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of cache contents and block allocation")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write all figures and machine facts")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw GB/s and the ratio to memcpy against tokens per chunk, a line per connector (needs "
                        "matplotlib: pip install 'kvgen[plot]'); without --tokens it sweeps "
                        + ",".join(map(str, SWEEP_TOKENS)) + " tokens: choose the set with --layouts/--objects")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--backend", type=_backends, default=["auto"], metavar="B,B",
                   help="copy backends to time, comma list of auto (what a connector picks by default), native "
                        "(the compiled CPU kernel), torch, triton; one row set per backend (default: auto)")
    p.add_argument("--all", action="store_true",
                   help="measure every built-in (and --specs) layout with each object it has a connector for, every "
                        "declared transfer and every model, instead of the short default set (overrides --layouts, "
                        "--objects, --transfers and --models)")
    p.add_argument("--remote", type=_csv, default=None, metavar="SRC:DST,...",
                   help="measure P/D transfers through NIXL instead (kvgen.remote plans between two agents, beside "
                        "NIXL's 4 MiB-descriptor copy and memcpy of the same bytes) for these layout pairs, at the "
                        "largest --tokens and each --remote-shapes")
    p.add_argument("--remote-shapes", default="1:1:16:16,2:4:16:32,4:2:16:16", metavar="TP:TP:N:N[:G],...",
                   help="source TP, destination TP, source and destination block sizes of each --remote row, and "
                        "the heads per group G of a side whose layout holds its heads in groups (default: 2 where "
                        "every rank's heads are whole groups of 2, else 1) (default: 1:1:16:16,2:4:16:32,4:2:16:16)")
    p.add_argument("--costs", action="store_true",
                   help="measure kvgen.remote's cost model constants on this machine and print them as "
                        "KVGEN_REMOTE_COSTS (with or without --remote)")
    p.add_argument("--busy", action="store_true",
                   help="measure with a neighbour process keeping every core busy with torch work (as a "
                        "co-located inference engine would); it starts before the first row and is stopped after")


def _progress(row: Any, done: int, total: int) -> None:
    naive = "no naive baseline" if row.naive_matches is None else \
        f"naive {row.gbps('naive'):.2f}, naive==kvgen {'yes' if row.naive_matches else 'NO'}"
    print(f"[{done}/{total}] {row.layout} {row.obj} T={row.tokens} {row.dir} ({row.backend}): {row.gbps():.2f} GB/s "
          f"(memcpy {row.gbps('memcpy'):.2f}, {naive})", file=sys.stderr, flush=True)


def _refusal(args: argparse.Namespace, present: list[str]) -> str | None:
    """Why the options cannot run here, or None."""
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        return ("--plot needs matplotlib, which is not installed; "
                "install it with `pip install 'kvgen[plot]'` (or drop --plot)")
    if args.device.split(":")[0] not in present:
        return f"device {args.device} is not available here (present: {', '.join(present)})"
    return None


def _write(args: argparse.Namespace, data: dict[str, Any], plot: Callable[[dict[str, Any], Path], None]) -> None:
    """The --json file and the --plot image, where asked for."""
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot(data, args.plot)
        print(f"wrote {args.plot}")


def tokens_of(args: argparse.Namespace) -> list[int]:
    """The chunk sizes to measure: --tokens, else the sweep of --plot, else the short default."""
    if args.tokens is not None:
        return list(args.tokens)
    return list(SWEEP_TOKENS if args.plot is not None else DEFAULT_TOKENS)


def main(args: argparse.Namespace) -> int:
    """Exit status: 0, 1 when the naive baseline disagreed with a connector, 2 for a
    selection or option that cannot run (the message names the valid choices)."""
    args.tokens = tokens_of(args)
    if getattr(args, "remote", None) or getattr(args, "costs", False):
        from kvgen.tools.bench import remote  # torch and nixl: the command line above stays torch-free

        args.remote_shapes = remote.shapes(args.remote_shapes)
        return remote.main(args)
    # torch: the command line above stays torch-free, as `kvgen build` loads it
    from kvgen.runtime import available_devices
    from kvgen.tools.bench import report
    from kvgen.tools.bench.run import run

    refusal = _refusal(args, available_devices())
    if refusal is not None:
        print(f"kvgen bench: {refusal}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "all", False):
            every_builtin(args, load_library(list(args.specs)))
        with neighbour() if args.busy else contextlib.nullcontext():
            result = run(args, None if args.quiet else _progress)
    except SpecError:
        raise  # the command line prints every problem of the user's specs
    except (KVGenError, KeyError, ValueError) as exc:
        print(f"kvgen bench: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    machine = report.machine_facts(str(args.device))
    data = report.as_json(result, machine)
    print("\n".join([report.text(result, machine), *goals.text(goals.judge(data))]))
    _write(args, data, draw)
    return 1 if any(r.naive_matches is False for r in result.rows) or any(
        not r.matches for r in (*result.transfers, *result.models)) else 0


__all__ = ["DEFAULT_LAYOUTS", "DEFAULT_MODELS", "DEFAULT_OBJECTS", "DEFAULT_TOKENS", "MLA_C", "add_arguments", "main",
           "tokens_of"]
