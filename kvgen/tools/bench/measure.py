"""Timing: contenders run in a rotated order on every repeat, ratios taken per repeat
(paired), spreads as min-median-max, and per-call micro timings. Pure Python: the clock
and the device sync are passed in, so tests drive it with fake timers."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Clock = Callable[[], float]

#: A memcpy baseline whose slowest repeat is more than this fraction slower than its
#: fastest measured a machine whose state changed during the row (another job, clocks):
#: its paired ratios are flagged as unreliable.
MEMCPY_VARIATION_LIMIT = 0.25


def rotation(names: Sequence[str], repeat: int) -> list[str]:
    """The contenders' order on `repeat`: each name leads once every len(names) repeats,
    so a cost that falls on whoever runs first (or after another) hits all alike."""
    k = repeat % len(names)
    return [*names[k:], *names[:k]]


def timed_repeats(fns: Mapping[str, Callable[[], None]], sync: Callable[[], None], warmup: int, repeats: int,
                  clock: Clock = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each function per repeat (index i of every list is repeat i), the order
    rotated on every repeat; `sync` waits for the device before each clock reading."""
    names = list(fns)
    for i in range(warmup):
        for name in rotation(names, i):
            fns[name]()
            sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in rotation(names, i):
            sync()
            t0 = clock()
            fns[name]()
            sync()
            times[name].append(clock() - t0)
    return times


@dataclass(frozen=True)
class Spread:
    """Min, median and max of a figure over the repeats."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(min(values), statistics.median(values), max(values))

    def cell(self) -> str:
        return f"{self.min:.3g}-{self.median:.3g}-{self.max:.3g}"


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """numerator[i] / denominator[i] for each repeat i: two contenders timed in the same
    repeat saw the same machine state, so their ratio cancels drift a median would not."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("paired ratios need the same, non-zero number of repeats on both sides")
    return Spread.of([n / d for n, d in zip(numerator, denominator, strict=True)])


def variation(seconds: Sequence[float]) -> float:
    """max / min - 1 of one contender's repeats: 0.0 when every repeat took as long."""
    return max(seconds) / min(seconds) - 1.0


def unstable(seconds: Sequence[float], limit: float = MEMCPY_VARIATION_LIMIT) -> bool:
    return variation(seconds) > limit


def micro(fn: Callable[..., object], iters: int, setup: Callable[[], object] | None = None,
          clock: Clock = time.perf_counter) -> float:
    """Median microseconds of one call: fn() or, with `setup`, fn(setup()) with setup untimed."""
    samples = []
    for _ in range(iters):
        arg = setup() if setup else None
        t0 = clock()
        fn(arg) if setup else fn()
        samples.append(clock() - t0)
    return statistics.median(samples) * 1e6


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """Resident memory one call of `fn` takes at its peak beyond what was resident before
    (temporaries included), on Linux: the peak is reset through /proc/self/clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return None
    before = _rss_kib("VmRSS")
    fn()
    peak = _rss_kib("VmHWM")
    if before is None or peak is None:
        return None
    return max(0, peak - before) * 1024


#: The contenders of every row, in their order on the first repeat.
CONTENDERS = ("kvgen", "memcpy", "naive")


class Timed:
    """What every bench row derives from `bytes` and `seconds` (per contender, per repeat)."""

    bytes: int
    seconds: Mapping[str, Sequence[float]]

    def gbps(self, contender: str = "kvgen") -> float:
        return self.bytes / statistics.median(self.seconds[contender]) / 1e9

    @property
    def x_memcpy(self) -> Spread:
        """kvgen's speed as a fraction of memcpy's, per repeat: memcpy seconds / kvgen seconds."""
        return paired_ratios(self.seconds["memcpy"], self.seconds["kvgen"])

    @property
    def memcpy_variation(self) -> float:
        return variation(self.seconds["memcpy"])

    @property
    def memcpy_unstable(self) -> bool:
        return unstable(self.seconds["memcpy"])


@dataclass(frozen=True)
class Row(Timed):
    """One direction of one connector at one token count: seconds per contender per repeat."""

    layout: str
    obj: str
    mode: str
    tokens: int
    dir: str
    bytes: int
    seconds: Mapping[str, Sequence[float]]
    #: None: no naive baseline for this layout (caches of several planes).
    naive_matches: bool | None
    #: What the connector moved data with ("native", "torch", "triton").
    backend: str = "torch"
    #: Extra resident memory one kvgen call took at its peak (None: not measurable here).
    peak_bytes: int | None = None

    @property
    def x_naive(self) -> Spread | None:
        """kvgen's speedup over the naive connector, per repeat (None without one)."""
        return paired_ratios(self.seconds["naive"], self.seconds["kvgen"]) if "naive" in self.seconds else None

    def as_dict(self) -> dict[str, object]:
        return {"layout": self.layout, "obj": self.obj, "mode": self.mode, "tokens": self.tokens, "dir": self.dir,
                "bytes": self.bytes, "seconds": statistics.median(self.seconds["kvgen"]),
                "gbps": self.gbps(), "memcpy_gbps": self.gbps("memcpy"),
                "naive_gbps": self.gbps("naive") if "naive" in self.seconds else None,
                "x_memcpy": vars(self.x_memcpy), "x_naive": vars(self.x_naive) if self.x_naive else None,
                "memcpy_variation": self.memcpy_variation, "memcpy_unstable": self.memcpy_unstable,
                "naive_matches": self.naive_matches, "backend": self.backend, "peak_bytes": self.peak_bytes,
                "repeat_seconds": {k: list(v) for k, v in self.seconds.items()}}


@dataclass(frozen=True)
class CheckCost:
    """Per-call cost of a connector's input checks: median microseconds by name of what was
    timed; a new check timing is one more entry, and the table and JSON show it as is."""

    layout: str
    obj: str
    us: Mapping[str, float]

    def as_dict(self) -> dict[str, object]:
        return {"layout": self.layout, "obj": self.obj, "us": dict(self.us)}
