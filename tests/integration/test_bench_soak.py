"""bench/soak.py on the CPU, so the soak cannot rot unseen: a short run of every request
kind through one real stack ends with no error, no service down and nothing left
running or holding KV in the worker; a short run of its fault mode (a worker and the
detokenizer killed under load) loses no request and reports counts that add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from radixserve.infra import free_port

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
KINDS = {"chat", "stream", "shared_n", "schema", "completion", "native"}
FAULT_KINDS = {"stream_greedy", "stream_seeded", "chat", "schema", "completion"}
IDLE = {"num_running_reqs": 0.0, "token_usage": 0.0}


def run_soak(nats_url: str, redis_url: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"RADIXSERVE_NATS_URL": nats_url, "RADIXSERVE_REDIS_URL": redis_url}
    command = [sys.executable, str(BENCH_DIR / "soak.py"), *argv]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=env, cwd=BENCH_DIR
    )


def test_a_short_soak_through_a_real_stack(
    nats_url: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "soak.json"
    argv = ["--model", str(tiny_model_dir), "--worker-args", "--max-total-tokens 16384"]
    argv += ["--minutes", "0.25", "--interval-s", "5", "--concurrency", "4"]
    argv += ["--port", str(free_port()), "--json", str(out)]
    done = run_soak(nats_url, redis_url, argv)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["requests"]) == KINDS and min(report["requests"].values()) >= 1
    assert report["errors"] == {} and report["down"] == []
    assert report["worker_left"] == {"worker-0": {"num_running_reqs": 0.0, "token_usage": 0.0}}
    samples = report["rss_mb"]
    assert len(samples) >= 3 and samples[-1]["requests"] == sum(report["requests"].values())
    assert all(samples[-1][name] > 0 for name in report["rss_growth_mb"])


def test_the_fault_mode_loses_no_request(
    nats_url: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """40 s, a kill every 12 s: the worker and the detokenizer each killed at least once
    (targets in turn), on servers of the soak's own (the shared ones are not touched)."""
    out = tmp_path / "faults.json"
    argv = ["--model", str(tiny_model_dir), "--worker-args", "--max-total-tokens 16384"]
    argv += ["--workers", "2", "--minutes", str(40 / 60), "--concurrency", "4"]
    argv += ["--fault-interval-s", "12", "--fault-targets", "worker,detokenizer"]
    argv += ["--port", str(free_port()), "--json", str(out)]
    done = run_soak(nats_url, redis_url, argv)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["lost"] == 0 and report["lost_requests"] == []
    assert report["requests"] == report["completed"] + sum(report["failed"].values())
    assert set(report["by_kind"]) == FAULT_KINDS
    assert sum(sum(kind.values()) for kind in report["by_kind"].values()) == report["requests"]
    killed = [kill["target"].rsplit("-", 1)[0] for kill in report["kills"]]
    assert {"worker", "detokenizer"} <= set(killed) and len(killed) >= 2
    assert all(kill["restarted_after_s"] is not None for kill in report["kills"])
    after_kills = sum(sum(kill["failed_until_next"].values()) for kill in report["kills"])
    assert after_kills <= sum(report["failed"].values())
    ttft = report["ttft_s"]
    streams_done = sum(
        report["by_kind"][k].get("completed", 0) for k in ("stream_greedy", "stream_seeded")
    )
    assert ttft["during_faults"]["n"] + ttft["outside"]["n"] == streams_done
    assert report["down"] == []
    assert report["worker_left"] == {"worker-0": IDLE, "worker-1": IDLE}
