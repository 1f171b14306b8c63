"""bench/soak.py on the CPU, so the soak cannot rot unseen: a short run of every request
kind through one real stack ends with no error, no service down and nothing left
running or holding KV in the worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from radixserve.infra import free_port

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
KINDS = {"chat", "stream", "shared_n", "schema", "completion", "native"}


def test_a_short_soak_through_a_real_stack(
    nats_url: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(BENCH_DIR / "soak.py"), "--model", str(tiny_model_dir)]
    argv += ["--worker-args", "--max-total-tokens 16384", "--minutes", "0.25"]
    argv += ["--interval-s", "5", "--concurrency", "4", "--port", str(free_port())]
    argv += ["--json", str(out)]
    env = os.environ | {"RADIXSERVE_NATS_URL": nats_url, "RADIXSERVE_REDIS_URL": redis_url}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=BENCH_DIR)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["requests"]) == KINDS and min(report["requests"].values()) >= 1
    assert report["errors"] == {} and report["down"] == []
    assert report["worker_left"] == {"num_running_reqs": 0.0, "token_usage": 0.0}
    samples = report["rss_mb"]
    assert len(samples) >= 3 and samples[-1]["requests"] == sum(report["requests"].values())
    assert all(samples[-1][name] > 0 for name in report["rss_growth_mb"])
