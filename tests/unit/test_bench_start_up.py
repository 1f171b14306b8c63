"""bench/start_up.py on the CPU, so the GPU benchmark cannot rot unseen: each run is its own
process with empty kernel caches, and its rows report what the engine did."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def _start_up(tokenizer: Path, out: Path, *flags: str) -> tuple[list[dict[str, Any]], str]:
    """The script on the tiny shape on the CPU: its rows and its printed table."""
    argv = [sys.executable, str(BENCH_DIR / "start_up.py"), "--tokenizer", str(tokenizer)]
    argv += ["--device", "cpu", "--shape", "tiny", "--input-len", "12", "--output-len", "3"]
    argv += [*flags, "--timeout-s", "300", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout


@pytest.mark.slow
def test_compare_runs_both_variants_in_fresh_processes(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    rows, table = _start_up(tiny_llama_dir, tmp_path / "rows.json", "--compare")
    assert [r["prefill_warm_up"] for r in rows] == [True, False]
    for row in rows:
        assert row["device"] == "cpu" and row["layers"] == 2
        assert row["ready_s"] > 0 and row["first_ms"] > 0 and row["second_ms"] > 0
    # The table names both runs.
    assert "\non " in table and "\noff " in table


@pytest.mark.slow
def test_first_of_each_times_every_kind_twice(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (row,), table = _start_up(tiny_llama_dir, tmp_path / "rows.json", "--first-of-each")
    monkeypatch.syspath_prepend(str(BENCH_DIR))  # the scripts import each other as siblings
    kinds = importlib.import_module("start_up").FIRST_KINDS
    assert list(row["kinds"]) == [name for name, _, _ in kinds]
    assert all(len(ms) == 2 and min(ms) > 0 for ms in row["kinds"].values())
    assert row["grammar_warm_up_ms"] > 0
    assert row["kernels_built"] == {}  # no Triton kernel runs on the CPU
    assert "json schema" in table
