"""The plain-text tables every bench report prints (connectors, transfers, models, check costs)."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A plain-text table; figure columns (rates, ratios, microseconds, counts) right-aligned."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    right = [i for i, h in enumerate(headers)
             if "/s" in h or h.startswith("x ") or h in ("tokens", "memcpy var", "peak MiB") or h.endswith(" us")]

    def line(values: Sequence[str]) -> str:
        cells = [v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(c) for c in cells)])
