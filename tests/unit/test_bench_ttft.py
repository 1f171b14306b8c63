"""bench/ttft.py on the CPU, so the GPU suite's TTFT stage cannot rot unseen: one engine
of the tiny shape, each prompt length's row read against what the script measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_rows_per_prompt_length_on_the_cpu(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    argv = [sys.executable, str(BENCH_DIR / "ttft.py"), "--tokenizer", str(tiny_llama_dir)]
    argv += ["--device", "cpu", "--shape", "tiny", "--input-lens", "4", "40", "--reps", "2"]
    argv += ["--overlap", "on", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["input_len"] for r in rows] == [4, 40]
    for row in rows:
        # On the CPU nothing overlaps: the step that prefills returns the first token.
        assert row["steps"] == 1 and len(row["step_host_ms"]) == 1
        assert 0 < row["first_step_device_ms"] <= row["ttft_ms"]
    assert "engine ready in" in done.stdout
