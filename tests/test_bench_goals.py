"""The speed-target table: each target judged on the rows of one run that it covers, at the
worst of them, and "not measured" when the run has none (never "met")."""

from __future__ import annotations

from kvgen.tools.bench import goals


def _spread(median: float, low: float | None = None) -> dict[str, float]:
    return {"min": median if low is None else low, "median": median, "max": median}


def _row(layout: str, tokens: int, direction: str, ratio: float, *, mode: str = "whole", planes: bool = False,
         peak: int = 0, low: float | None = None) -> dict:
    return {"layout": layout, "obj": "kv_planes" if planes else "kv_2ltd", "mode": mode, "tokens": tokens,
            "dir": direction, "x_memcpy": _spread(ratio, low), "naive_matches": None if planes else True,
            "peak_bytes": peak}


def _verdicts(doc: dict) -> dict[str, goals.Verdict]:
    return {v.goal.name: v for v in goals.judge(doc)}


def test_each_target_sees_only_its_rows_and_the_worst_one_decides() -> None:
    doc = {"config": {}, "rows": [_row("a", 256, "load", 0.9, mode="layerwise"),
                                  _row("b", 256, "load", 0.5, mode="layerwise"),
                                  _row("b", 256, "store", 0.4, mode="layerwise"),  # a store: not a layerwise load
                                  _row("p", 2048, "store", 0.75, planes=True),
                                  _row("a", 2048, "load", 0.1)],  # 2048, classic: in no target here
           "transfers": [{"src": "x", "dst": "y", "mode": "whole", "tokens": 2048, "x_memcpy": _spread(0.9),
                          "x_two_copy": _spread(1.5), "peak_extra_bytes": 0}],
           "models": []}
    found = _verdicts(doc)
    layerwise = found["layerwise loads, 256 tokens"]
    assert (layerwise.count, layerwise.worst, layerwise.met) == (2, ("b kv_2ltd layerwise load T=256", 0.5), False)
    assert found["every connector, 256 tokens"].worst == ("b kv_2ltd layerwise store T=256", 0.4)
    assert found["caches of several planes, 2048 tokens"].met is True
    assert found["transfers, 2048 tokens, x memcpy"].met is True
    assert found["transfers, 2048 tokens, x two-copy path"].met is False
    assert found["model connectors, 2048 tokens"].met is None
    assert found["model connectors, 2048 tokens"].cells()[-1] == "not measured"
    assert not any(v.goal.busy for v in found.values())


def test_a_busy_run_is_held_to_the_busy_floors_on_every_path_and_its_worst_repeat() -> None:
    doc = {"config": {"busy": True}, "rows": [_row("a", 256, "store", 0.7, low=0.25), _row("a", 2048, "store", 0.65)],
           "transfers": [], "models": [{"model": "m", "dir": "load", "tokens": 2048, "x_memcpy": _spread(0.61)}]}
    found = _verdicts(doc)
    assert set(found) == {g.name for g in goals.GOALS if g.busy}
    assert found["busy host: every path, median"].met is True
    assert found["busy host: every path, worst repeat"].worst == ("a kv_2ltd whole store T=256", 0.25)
    assert found["busy host: every path, worst repeat"].met is False


def test_peak_memory_that_grows_with_the_chunk_fails_and_page_noise_does_not() -> None:
    steady = [_row("a", t, "load", 1.0, peak=4096 * (t % 7)) for t in (256, 2048)]
    growing = [_row("b", t, "load", 1.0, peak=t * 4096) for t in (256, 2048)]
    found = _verdicts({"config": {}, "rows": steady, "transfers": [], "models": []})
    assert found["peak extra memory independent of chunk size"].met is True
    found = _verdicts({"config": {}, "rows": steady + growing, "transfers": [], "models": []})
    peak = found["peak extra memory independent of chunk size"]
    assert peak.met is False and peak.worst[0] == "b kv_2ltd whole load"


def test_the_table_says_how_many_targets_were_met() -> None:
    lines = goals.text(goals.judge({"config": {}, "rows": [_row("a", 256, "load", 0.8, mode="layerwise")]}))
    assert "2 met, 0 not met, 5 not measured by this run" in lines[1]
    assert "layerwise loads, 256 tokens" in lines[2]
