"""`kvgen bench --plot`: GB/s against chunk size. One panel per direction (store, load), a line
per connector (layout, object, mode, backend) and the memcpy of the same bytes beside it, and
below them the ratio to memcpy with the issue's 0.7x floor drawn in; transfers and model
connectors get a panel each when the run measured them. Reads only the --json document, so a
saved run can be drawn again (`kvgen.tools.bench.plot.draw(json.load(f), path)`)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: The sizes `--plot` sweeps when --tokens is not given: 16 to 8192 tokens, by fours then the last
#: doubling (8192 tokens is 1 GiB per object at the default geometry).
SWEEP_TOKENS = (16, 64, 256, 1024, 4096, 8192)
#: The ratio to memcpy the speed issue asks every connector to reach; drawn as a line.
TARGET_RATIO = 0.7

Series = dict[str, list[tuple[int, float, float]]]  # label -> [(tokens, GB/s, x memcpy median)]


def series(rows: Iterable[Mapping[str, Any]], label_keys: tuple[str, ...]) -> Series:
    """The rows as lines: one per distinct label, its points ordered by tokens."""
    out: Series = {}
    for r in rows:
        label = " ".join(str(r[k]) for k in label_keys if r.get(k) not in (None, ""))
        ratio = r["x_memcpy"]["median"] if isinstance(r.get("x_memcpy"), Mapping) else r.get("x_memcpy")
        out.setdefault(label, []).append((int(r["tokens"]), float(r["gbps"]), float(ratio or 0.0)))
    return {k: sorted(v) for k, v in sorted(out.items())}


def memcpy_line(rows: Iterable[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """Median memcpy GB/s of the rows at each chunk size (memcpy of each row's own bytes)."""
    by_tokens: dict[int, list[float]] = {}
    for r in rows:
        if r.get("memcpy_gbps"):
            by_tokens.setdefault(int(r["tokens"]), []).append(float(r["memcpy_gbps"]))
    return sorted((t, statistics.median(v)) for t, v in by_tokens.items())


def panels(data: Mapping[str, Any]) -> list[tuple[str, Series, list[tuple[int, float]]]]:
    """(title, lines, memcpy line) of every panel the document has rows for."""
    out = []
    rows = data.get("rows", [])
    for direction in ("store", "load"):
        sel = [r for r in rows if r["dir"] == direction]
        if sel:
            out.append((f"connectors, {direction}", series(sel, ("layout", "obj", "mode", "backend")),
                        memcpy_line(sel)))
    for key, title in (("transfers", "layout-to-layout transfers"), ("models", "model connectors")):
        sel = [_as_row(r) for r in data.get(key, []) if r.get("gbps")]
        if sel:
            out.append((title, series(sel, ("label", "dir")), memcpy_line(sel)))
    return out


def _as_row(r: Mapping[str, Any]) -> dict[str, Any]:
    """A transfer or model row in the connector rows' terms (label, dir, tokens, GB/s, ratio)."""
    label = f"{r['src']} -> {r['dst']}" if "src" in r else str(r["model"])
    return {**r, "label": label, "dir": r.get("dir") or r.get("mode", "")}


def draw(data: Mapping[str, Any], path: Path) -> None:
    """Draw `data` (the --json document) into the image file `path`."""
    import matplotlib  # optional (the plot extra): only `kvgen bench --plot` needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    found = panels(data)
    if not found:
        raise ValueError("nothing to plot: the run measured no rows")
    fig, axes = plt.subplots(2, len(found), figsize=(6.5 * len(found), 9), squeeze=False)
    for col, (title, lines, memcpy) in enumerate(found):
        speed, ratio = axes[0][col], axes[1][col]
        for label, points in lines.items():
            tokens = [p[0] for p in points]
            speed.plot(tokens, [p[1] for p in points], marker="o", label=label)
            ratio.plot(tokens, [p[2] for p in points], marker="o", label=label)
        if memcpy:
            speed.plot([t for t, _ in memcpy], [g for _, g in memcpy], "k--", label="memcpy (median of rows)")
        ratio.axhline(TARGET_RATIO, color="k", linestyle=":", label=f"{TARGET_RATIO}x target")
        for ax, ylabel in ((speed, "GB/s"), (ratio, "x memcpy (median of repeats)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per chunk")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        speed.set_title(title)
        speed.legend(fontsize=6)
    m = data["machine"]
    fig.suptitle(f"kvgen bench on {m['device']} ({m['cpu_model']}, {m['cpu_count']} CPUs, torch {m['torch']})"
                 + ("; busy neighbour" if data.get("config", {}).get("busy") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
