"""bench/sampling.py's CPU mode: it times both CPU paths for every setting, and the
candidate search draws what the whole-row sort draws (at SmolLM2's vocabulary size)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("sampling")


def test_cpu_mode_times_both_paths_and_they_pick_alike(bench: ModuleType) -> None:
    tiers = bench.sampler.CANDIDATES
    rows = bench.cpu_bench([3], reps=1, scale=3.0)
    assert bench.sampler.CANDIDATES == tiers  # restored after the whole-sort runs
    timed = {(r["setting"], r["path"]) for r in rows}
    assert timed == {(s, p) for s in bench.SETTINGS for p in ("candidates", "full sort")}
    assert all(isinstance(r["ms"], float) and r["ms"] > 0 for r in rows)
    same = {r["setting"]: r["same_picks"] for r in rows if "same_picks" in r}
    assert same == {s: 1.0 for s in bench.SETTINGS}
