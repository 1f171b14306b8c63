"""bench/start_up.py on the CPU, so the GPU benchmark cannot rot unseen: each run is its own
process with empty kernel caches, and its rows report what the engine did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def test_compare_runs_both_variants_in_fresh_processes(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rows.json"
    argv = [sys.executable, str(BENCH_DIR / "start_up.py"), "--tokenizer", str(tiny_llama_dir)]
    argv += ["--device", "cpu", "--shape", "tiny", "--input-len", "12", "--output-len", "3"]
    argv += ["--compare", "--timeout-s", "300", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["prefill_warm_up"] for r in rows] == [True, False]
    for row in rows:
        assert row["device"] == "cpu" and row["layers"] == 2
        assert row["ready_s"] > 0 and row["first_ms"] > 0 and row["second_ms"] > 0
    # The table names both runs.
    assert "\non " in done.stdout and "\noff " in done.stdout


def test_first_of_each_times_every_kind_twice(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = [sys.executable, str(BENCH_DIR / "start_up.py"), "--tokenizer", str(tiny_llama_dir)]
    argv += ["--device", "cpu", "--shape", "tiny", "--input-len", "12", "--output-len", "3"]
    argv += ["--first-of-each", "--timeout-s", "300", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    sys.path.insert(0, str(BENCH_DIR))
    from start_up import FIRST_KINDS

    assert list(row["kinds"]) == [name for name, _, _ in FIRST_KINDS]
    assert all(len(ms) == 2 and min(ms) > 0 for ms in row["kinds"].values())
    assert row["grammar_warm_up_ms"] > 0
    assert "json schema" in done.stdout
