"""bench/online.py on the CPU, so the GPU load test cannot rot unseen: one real stack
(NATS, Redis, the six services) loaded at two rates, each row read against what was sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from radixserve.infra import free_port

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
PROMPTS, OUTPUT_LEN = 6, 5


def test_two_rates_through_a_real_stack(
    nats_url: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rows.json"
    argv = [sys.executable, str(BENCH_DIR / "online.py"), "--model", str(tiny_model_dir)]
    argv += ["--worker-args", "--max-total-tokens 16384", "--rates", "40", "inf"]
    argv += ["--dataset-name", "random", "--random-input-len", "48"]
    argv += ["--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1"]
    argv += ["--num-prompts", str(PROMPTS)]
    argv += ["--port", str(free_port()), "--json", str(out)]
    env = os.environ | {"RADIXSERVE_NATS_URL": nats_url, "RADIXSERVE_REDIS_URL": redis_url}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=BENCH_DIR)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [row["request_rate"] for row in rows] == [40.0, "inf"]
    for row in rows:
        assert row["completed"] == PROMPTS and row["failed"] == 0, row["errors"]
        # EOS ignored: every request generated exactly its output length (range ratio 1).
        assert row["total_output_tokens"] == PROMPTS * OUTPUT_LEN
        assert 0 < row["median_ttft_ms"] <= row["median_e2e_latency_ms"]
        # The worker's own figures over the phase: it stepped, in batches of >= 1 row.
        assert row["worker_steps"] >= OUTPUT_LEN and row["worker_batch"] >= 1
        assert 0 < row["worker_busy"] <= 1.5 and row["client_cpu"] >= 0
    # The table names every row's rate.
    assert "rate (req/s)" in done.stdout and "inf" in done.stdout
