"""`radixserve bench serving --dataset-path` and bench/serving_peers.py against a real stack
(NATS, Redis, the six services; a tiny random-weight Llama with the SmolLM2 tokenizer).
The references: what the dataset readers asked for (EOS is ignored, so every request
generates exactly its output length) and what the server's `usage` counted."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from radixserve.benchmark.serving import build_requests
from radixserve.cli import build_parser
from tests.helpers.sharegpt_files import write_prompt_file, write_sharegpt_file
from tests.integration.stack_fixture import RunningStack

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def bench_serving(*argv: str, out: Path) -> dict[str, Any]:
    argv = ("bench", "serving", *argv, "--disable-tqdm", "--output-file", str(out))
    done = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", *argv], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Serving Benchmark Result" in done.stdout
    summary: dict[str, Any] = json.loads(out.read_text().splitlines()[-1])
    return summary


def asked_for(*argv: str) -> list[Any]:
    """The requests the command builds from the same flags (same seed, same reader)."""
    ns = build_parser().parse_args(["bench", "serving", *argv])
    return build_requests(ns, random.Random(ns.seed))


def test_sharegpt_file_through_the_stack(
    tiny_stack: RunningStack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = write_sharegpt_file(tmp_path / "sharegpt.json", n=12, seed=4)
    flags = ["--dataset-path", str(path), "--tokenizer", str(tiny_model_dir)]
    flags += ["--num-prompts", "6", "--sharegpt-context-len", "96"]
    requests = asked_for(*flags)
    assert len(requests) == 6 and all(isinstance(r.prompt, str) for r in requests)
    argv = [*flags, "--base-url", tiny_stack.url, "--request-rate", "50"]
    summary = bench_serving(*argv, "--goodput", "e2el:60000", out=tmp_path / "a.jsonl")
    assert (summary["dataset_name"], summary["completed"], summary["failed"]) == ("sharegpt", 6, 0)
    assert summary["total_output_tokens"] == sum(r.output_len for r in requests)
    # The server counts the text prompts as the reader did (the same tokenizer, BOS included).
    assert summary["total_input_tokens"] == sum(r.prompt_len for r in requests)
    assert summary["good_completed"] == 6 and summary["request_goodput"] > 0
    assert 0 < summary["median_ttft_ms"] <= summary["p99_e2el_ms"]
    strict = bench_serving(*argv, "--goodput", "ttft:0", out=tmp_path / "b.jsonl")
    assert strict["completed"] == 6 and strict["good_completed"] == 0


def test_prompt_file_through_the_native_backend(
    tiny_stack: RunningStack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = write_prompt_file(tmp_path / "prompts.jsonl", n=4, seed=5)
    flags = ["--dataset-path", str(path), "--tokenizer", str(tiny_model_dir)]
    flags += ["--num-prompts", "4", "--sharegpt-output-len", "5"]
    summary = bench_serving(
        *flags, "--backend", "radixserve", "--base-url", tiny_stack.url, out=tmp_path / "c.jsonl"
    )
    assert (summary["dataset_name"], summary["completed"], summary["failed"]) == ("custom", 4, 0)
    assert summary["total_output_tokens"] == 4 * 5
    assert summary["total_input_tokens"] == sum(r.prompt_len for r in asked_for(*flags))


def test_serving_peers_ladder_against_a_url(tiny_stack: RunningStack, tmp_path: Path) -> None:
    prompts, output_len = 3, 4
    earlier = tmp_path / "peer.json"  # an earlier run's rows, as --json writes them
    peer_rows = [{"request_rate": rate, "completed": prompts} for rate in (20.0, "inf")]
    earlier.write_text(json.dumps({"settings": {"label": "peer"}, "rows": peer_rows}))
    out, table = tmp_path / "rows.json", tmp_path / "peers.md"
    argv = [sys.executable, str(BENCH_DIR / "serving_peers.py"), "--url", tiny_stack.url]
    argv += ["--label", "stack", "--rates", "20", "inf", "--num-prompts", str(prompts)]
    argv += ["--warmup-prompts", "1", "--json", str(out), "--markdown", str(table)]
    argv += ["--against", str(earlier), "--goodput", "e2el:60000"]
    argv += ["--dataset-name", "random", "--random-input-len", "24"]
    argv += ["--random-output-len", str(output_len), "--random-range-ratio", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=BENCH_DIR)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["request_rate"] for row in rows] == [20.0, "inf"]
    for row in rows:
        assert row["completed"] == prompts and row["failed"] == 0, row["errors"]
        assert row["total_output_tokens"] == prompts * output_len
        assert row["good_completed"] == prompts
        assert 0 < row["median_ttft_ms"] <= row["p99_ttft_ms"]
    # One table, rate by rate, this run's line before the earlier run's within a rate.
    lines = table.read_text().splitlines()
    assert lines[0].startswith("| rate (req/s) | server | req/s | output tok/s | TTFT p50 ms")
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[:2] for row in cells] == [
        ["20.0", "stack"],
        ["20.0", "peer"],
        ["inf", "stack"],
        ["inf", "peer"],
    ]
    assert cells[1][2:4] == ["-", "-"]  # the earlier run's rows hold no figures here
    assert float(cells[0][3]) > 0  # output tok/s
