"""The benchmark's summary: counts, throughputs, latency percentiles, cache hit rate, goodput.

    summary = summarize(results, duration_s=12.3, settings={"backend": "openai", ...},
                        slos={"ttft": 50.0, "tpot": 6.0})
    print(render_table(summary))
    json.dumps(summary)                      # the `--output-file` line

Key names are both SGLang's bench_serving's (`total_throughput`, `*_e2e_latency_ms`,
`concurrency`) and vLLM's bench serve's (`total_token_throughput`, `*_e2el_ms`,
`request_goodput`, `p50_*`), so results from all three tools line up. TPOT is per
request, (e2e - TTFT) / (output tokens - 1), over requests with more than one output
token; ITL pools every gap between chunks. The cache hit rate is cached / prompt tokens
over the requests whose server reported `cached_tokens` (None when none did).

Goodput (vLLM's): a completed request is good when it meets every objective given in
milliseconds (TTFT, TPOT, end-to-end; a one-token request's TPOT counts as 0, as vLLM
counts it); `request_goodput` is good requests per second (None without objectives).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from radixserve.benchmark.client import RequestResult

LATENCIES = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-Token Latency", "ITL"),
    ("e2e_latency", "End-to-End Latency", "E2E Latency"),
)
KEY_ALIASES = {"e2e_latency": "e2el"}  # SGLang's name, then vLLM's
STATS = (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99"))  # shown
PERCENTILES = (50, 90, 95, 99)


def _stats(values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    stats = {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "std": float(ms.std()),
        "max": float(ms.max()),
    }
    for p in PERCENTILES:
        stats[f"p{p}"] = float(np.percentile(ms, p))
    return stats


def _tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def good_requests(done: Sequence[RequestResult], slos: Mapping[str, float]) -> int:
    """Completed requests within every objective (milliseconds by vLLM's metric name)."""

    def within(r: RequestResult) -> bool:
        seconds = {"ttft": r.ttft, "tpot": _tpot(r) or 0.0, "e2el": r.latency}
        return all(seconds[name] * 1000.0 <= ms for name, ms in slos.items())

    return sum(within(r) for r in done)


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    settings: Mapping[str, Any],
    slos: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    done = [r for r in results if r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    reported = [r for r in done if r.cached_tokens is not None]
    reported_prompt = sum(r.prompt_len for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    summary: dict[str, Any] = dict(settings)
    summary.update(
        {
            "duration": duration_s,
            "completed": len(done),
            "failed": len(results) - len(done),
            "total_input_tokens": input_tokens,
            "total_output_tokens": output_tokens,
            "total_cached_tokens": cached,
            "request_throughput": len(done) / duration_s,
            "input_throughput": input_tokens / duration_s,
            "output_throughput": output_tokens / duration_s,
            "total_throughput": (input_tokens + output_tokens) / duration_s,
            "total_token_throughput": (input_tokens + output_tokens) / duration_s,
            "concurrency": sum(r.latency for r in done) / duration_s,
            "cache_hit_rate": cached / reported_prompt if reported_prompt else None,
            "goodput_slos_ms": dict(slos) if slos else None,
            "good_completed": good_requests(done, slos) if slos else None,
        }
    )
    good = summary["good_completed"]
    summary["request_goodput"] = None if good is None else good / duration_s
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for t in map(_tpot, done) if t is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2e_latency": [r.latency for r in done],
    }
    for key, _, _ in LATENCIES:
        for stat, value in _stats(samples[key]).items():
            summary[f"{stat}_{key}_ms"] = value
            if key in KEY_ALIASES:
                summary[f"{stat}_{KEY_ALIASES[key]}_ms"] = value
    errors = [r.error for r in results if not r.success and r.error]
    summary["errors"] = sorted(set(errors))[:10]
    return summary


def render_table(summary: Mapping[str, Any]) -> str:
    def row(label: str, value: Any) -> str:
        if isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label + ':':<44}{value}"

    hit_rate = summary["cache_hit_rate"]
    lines = [
        "{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="),
        row("Backend", summary.get("backend", "")),
        row("Dataset", summary.get("dataset_name", "")),
        row("Traffic request rate", summary.get("request_rate", "")),
        row("Max request concurrency", summary.get("max_concurrency") or "not set"),
        row("Successful requests", summary["completed"]),
        row("Failed requests", summary["failed"]),
        row("Benchmark duration (s)", summary["duration"]),
        row("Total input tokens", summary["total_input_tokens"]),
        row("Total generated tokens", summary["total_output_tokens"]),
        row("Total cached prompt tokens", summary["total_cached_tokens"]),
        row("Request throughput (req/s)", summary["request_throughput"]),
        row("Input token throughput (tok/s)", summary["input_throughput"]),
        row("Output token throughput (tok/s)", summary["output_throughput"]),
        row("Total token throughput (tok/s)", summary["total_throughput"]),
        row("Cache hit rate", "not reported" if hit_rate is None else f"{hit_rate:.3f}"),
    ]
    if summary.get("request_goodput") is not None:
        lines.append(row("Request goodput (req/s)", summary["request_goodput"]))
    for key, title, short in LATENCIES:
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat, label in STATS:
            lines.append(row(f"{label} {short} (ms)", summary[f"{stat}_{key}_ms"]))
    lines.append("=" * 60)
    return "\n".join(lines)
