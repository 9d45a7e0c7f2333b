"""The speed targets kvgen holds itself to, checked against one bench run (its --json
document), so the table that says which hold comes from the same run as the figures.

Every target is a floor on the ratio to memcpy of the same bytes in the same run (or to the
two-copy path), taken at the median of the paired repeats; a run on a busy host (`--busy`) is
held to the busy floors instead. A target whose rows the run did not measure is reported as
"not measured", never as met. Pure Python: no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvgen.tools.bench.text_table import table

Doc = Mapping[str, Any]
Pick = Callable[[Doc], list[tuple[str, float]]]  # (row label, measured value)

#: Slack on "peak memory independent of the chunk size": resident-set readings move by a few
#: pages between calls, so growth under 1 MiB from the smallest chunk to the largest is noise.
PEAK_SLACK = 1 << 20


@dataclass(frozen=True)
class Goal:
    """One target: what it covers, its floor, and the (label, value) pairs a run gives it."""

    name: str
    floor: float
    pick: Pick
    busy: bool = False  # a target of --busy runs (else of quiet-host runs)


@dataclass(frozen=True)
class Verdict:
    goal: Goal
    count: int
    worst: tuple[str, float] | None

    @property
    def met(self) -> bool | None:
        return None if self.worst is None else self.worst[1] >= self.goal.floor

    def cells(self) -> list[str]:
        if self.worst is None:
            return [self.goal.name, f">= {self.goal.floor:g}", "0", "-", "-", "not measured"]
        label, value = self.worst
        return [self.goal.name, f">= {self.goal.floor:g}", str(self.count), f"{value:.2f}", label,
                "met" if self.met else "NOT MET"]


def _median(spread: Any) -> float:
    return float(spread["median"] if isinstance(spread, Mapping) else spread)


def _label(r: Mapping[str, Any]) -> str:
    if "src" in r:
        return f"{r['src']}->{r['dst']} {r['mode']} T={r['tokens']}"
    if "model" in r:
        return f"{r['model']} {r['dir']} T={r['tokens']}"
    return f"{r['layout']} {r['obj']} {r['mode']} {r['dir']} T={r['tokens']}"


def _ratios(key: str, rows: str, where: Callable[[Mapping[str, Any]], bool],
            of: Callable[[Any], float] = _median) -> Pick:
    """The `key` ratio of the document's `rows` list that satisfy `where`."""
    return lambda doc: [(_label(r), of(r[key])) for r in doc.get(rows, []) if r.get(key) is not None and where(r)]


def _every_path(of: Callable[[Any], float]) -> Pick:
    """x memcpy of every connector, transfer and model row."""
    picks = [_ratios("x_memcpy", rows, lambda r: True, of) for rows in ("rows", "transfers", "models")]
    return lambda doc: [p for pick in picks for p in pick(doc)]


def _peak_growth(doc: Doc) -> list[tuple[str, float]]:
    """Per connector and transfer: 1.0 when the peak extra memory of its largest chunk stays within
    PEAK_SLACK of its smallest chunk's, else smallest/largest (under 1, so the floor 1.0 fails it)."""
    groups: dict[str, dict[int, int]] = {}
    for rows, peak in (("rows", "peak_bytes"), ("transfers", "peak_extra_bytes")):
        for r in doc.get(rows, []):
            if r.get(peak) is not None:
                key = _label(r).rsplit(" T=", 1)[0]
                groups.setdefault(key, {})[int(r["tokens"])] = int(r[peak])
    out = []
    for key, by_tokens in groups.items():
        if len(by_tokens) > 1:
            small, large = by_tokens[min(by_tokens)], by_tokens[max(by_tokens)]
            out.append((key, 1.0 if large <= small + PEAK_SLACK else max(small, 1) / large))
    return out


def _at(tokens: int) -> Callable[[Mapping[str, Any]], bool]:
    return lambda r: int(r["tokens"]) == tokens


GOALS: tuple[Goal, ...] = (
    Goal("transfers, 2048 tokens, x memcpy", 0.85, _ratios("x_memcpy", "transfers", _at(2048))),
    Goal("transfers, 2048 tokens, x two-copy path", 1.6, _ratios("x_two_copy", "transfers", _at(2048))),
    Goal("caches of several planes, 2048 tokens", 0.7,
         _ratios("x_memcpy", "rows", lambda r: _at(2048)(r) and r.get("naive_matches") is None)),
    Goal("model connectors, 2048 tokens", 0.7, _ratios("x_memcpy", "models", _at(2048))),
    Goal("layerwise loads, 256 tokens", 0.7,
         _ratios("x_memcpy", "rows", lambda r: _at(256)(r) and r["mode"] == "layerwise" and r["dir"] == "load")),
    Goal("every connector, 256 tokens", 0.7, _ratios("x_memcpy", "rows", _at(256))),
    Goal("peak extra memory independent of chunk size", 1.0, _peak_growth),
    Goal("busy host: every path, median", 0.6, _every_path(_median), busy=True),
    Goal("busy host: every path, worst repeat", 0.3, _every_path(lambda s: float(s["min"])), busy=True),
    Goal("busy host: peak extra memory independent of chunk size", 1.0, _peak_growth, busy=True),
)


def judge(doc: Doc, goals: Iterable[Goal] = GOALS) -> list[Verdict]:
    """The verdict on each target of this run's kind (busy or quiet host)."""
    busy = bool(doc.get("config", {}).get("busy"))
    out = []
    for goal in goals:
        if goal.busy != busy:
            continue
        found = goal.pick(doc)
        out.append(Verdict(goal, len(found), min(found, key=lambda p: p[1]) if found else None))
    return out


HEADERS = ("target", "floor", "rows", "worst", "worst row", "verdict")


def text(verdicts: list[Verdict]) -> list[str]:
    """The targets table of a run's report, with a one-line summary above it."""
    if not verdicts:
        return []
    met = sum(1 for v in verdicts if v.met)
    missed = sum(1 for v in verdicts if v.met is False)
    unmeasured = sum(1 for v in verdicts if v.met is None)
    kind = "busy-host" if verdicts[0].goal.busy else "quiet-host"
    return ["", f"Speed targets ({kind} floors on x memcpy medians unless named; worst row shown): "
                f"{met} met, {missed} not met, {unmeasured} not measured by this run",
            table(HEADERS, [v.cells() for v in verdicts])]
