"""bench/offline.py at a tiny scale on the CPU, so the GPU benchmark cannot rot unseen:
its counts agree with the workload it was given, and the radix cache shows up in them."""

from __future__ import annotations

import importlib
import json
import random
import re
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from types import ModuleType

import pytest
import torch

from radixserve import Engine
from radixserve.benchmark.datasets import generated_shared_prefix

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
PROBES_DIR = Path(__file__).resolve().parents[2] / "lab" / "probes"


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))  # the scripts import each other as siblings
    return importlib.import_module("offline")


@pytest.mark.slow
def test_shared_prefix_counts_and_cache_hits(offline: ModuleType, tiny_llama_dir: Path) -> None:
    requests = generated_shared_prefix(
        random.Random(0),
        num_groups=2,
        prompts_per_group=3,
        system_prompt_len=24,
        question_len=4,
        output_len=5,
    )
    workload = offline.Workload("shared-prefix", requests, shared_prefix_len=24, group_size=3)

    def make_engine(radix: bool) -> Engine:
        # Prompts longer than a chunk: the first of a group is cached before the rest run.
        return Engine(
            model_path=str(tiny_llama_dir),
            device="cpu",
            disable_radix_cache=not radix,
            chunked_prefill_size=16,
        )

    # A bandwidth so high that no step is bound by its weight read: the floor's
    # projections are their FLOPs alone (test_bench_roofline checks the read bound).
    rates = offline.Rates(matmul=1e9, bandwidth=1e18)
    rows = offline.bench(make_engine, [workload], [True, False], rates)
    assert [(r["workload"], r["radix"]) for r in rows] == [
        ("shared-prefix", "on"),
        ("shared-prefix", "off"),
    ]
    for row in rows:
        assert row["requests"] == row["completed"] == 6
        assert row["input_tokens"] == 6 * 28
        assert row["output_tokens"] == 6 * 5  # ignore_eos: exactly max_new_tokens each
        assert row["total_throughput"] == pytest.approx(
            (row["input_tokens"] + row["output_tokens"]) / row["duration_s"]
        )
        # The step profile covers the run: 5 decode rounds at least, prefill split in 16s.
        assert row["steps"] == row["prefill_steps"] + row["decode_steps"]
        assert row["prefill_steps"] >= 2 and row["decode_steps"] >= 1
        assert row["prefill_steps_s"] + row["decode_steps_s"] <= row["duration_s"]
        assert row["outside_steps_s"] == pytest.approx(
            row["duration_s"] - row["prefill_steps_s"] - row["decode_steps_s"]
        )
        assert 0 < row["submit_s"] <= row["outside_steps_s"]
        assert row["allocator"] == {}  # the caching allocator's counters are CUDA's
        # No Triton kernel runs on the CPU, so none was built in a step.
        assert row["kernel_builds"] == 0 and row["kernel_builds_listed"] == []
        assert all(s["kernel_builds"] == 0 for s in row["slowest_steps"])
        # The device clock is CUDA's too: no device times, the series without them.
        assert row["device_idle_s"] == row["prefill_steps_device_s"] == 0.0
        assert all(s["device_s"] == s["idle_s"] == 0.0 for s in row["slowest_steps"])
        assert {len(entry) for entry in row["step_series"]} == {4}
        # The host's waits for the device are part of its step times.
        assert 0 <= row["prefill_steps_wait_s"] <= row["prefill_steps_s"]
        assert 0 <= row["decode_steps_wait_s"] <= row["decode_steps_s"]
        assert all(0 <= entry[3] <= entry[0] for entry in row["step_series"])
        assert len(row["step_series"]) == row["steps"]
        # The slowest steps, slowest first, each one of the run's steps.
        slowest = row["slowest_steps"]
        assert 0 < len(slowest) <= importlib.import_module("common.step_probes").SLOWEST
        assert [s["s"] for s in slowest] == sorted((s["s"] for s in slowest), reverse=True)
        assert len({s["index"] for s in slowest}) == len(slowest) < row["steps"] + 1
        assert 0 < row["prefill_tokens_per_step"] <= 16
        # The decode steps' rows: every decode step in one 32-row bucket, at most 6 rows.
        assert sum(row["decode_steps_by_rows"].values()) == row["decode_steps"]
        quantiles = list(row["decode_rows_quantiles"].values())
        assert quantiles == sorted(quantiles) and 1 <= quantiles[0] and quantiles[-1] <= 6
    on, off = rows
    assert on["cache_hit_rate"] > 0 and on["cached_tokens"] > 0
    assert off["cache_hit_rate"] == 0 and off["cached_tokens"] == 0
    assert offline.radix_ratios(rows).keys() == {"shared-prefix"}
    # Each run against its floor: the projections over the tokens it computed (prompt
    # tokens not cached, one a decode step) and the head over each sampled token.
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    hidden, inter, layers = (
        config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")
    )
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out, kv_out = (
        config["num_attention_heads"] * head_dim,
        config["num_key_value_heads"] * head_dim,
    )
    params = layers * (hidden * (2 * q_out + 2 * kv_out) + 3 * hidden * inter)
    for row in rows:
        computed = row["input_tokens"] - row["cached_tokens"] + row["output_tokens"] - 6
        flops = 2 * params * computed + 2 * hidden * config["vocab_size"] * row["output_tokens"]
        assert row["floor_projections_s"] == pytest.approx(flops / rates.matmul)
        assert row["floor_s"] == pytest.approx(
            row["floor_projections_s"]
            + row["floor_prefill_attention_s"]
            + row["floor_decode_attention_s"]
        )
        assert row["of_floor"] == pytest.approx(row["floor_s"] / row["duration_s"])
    # The cache computes less and, decoding each group over one read of its prefix, reads less.
    assert on["floor_prefill_attention_s"] < off["floor_prefill_attention_s"]
    assert on["floor_decode_attention_s"] < off["floor_decode_attention_s"]
    floor_ratio = offline.floor_ratios(rows)["shared-prefix"]
    assert floor_ratio == pytest.approx(off["floor_s"] / on["floor_s"])


def test_warmup_is_each_workloads_head_with_short_outputs(offline: ModuleType) -> None:
    shared = offline.shared_prefix_workload(scale=0.1)
    sharegpt = offline.sharegpt_workload(scale=0.003)
    warm = offline.warmup_requests([shared, sharegpt])
    n = offline.WARMUP_REQUESTS
    assert len(warm) == n + len(sharegpt.requests)  # 3 ShareGPT requests: all of them
    assert [w.prompt for w in warm[:n]] == [r.prompt for r in shared.requests[:n]]
    assert all(w.output_len == offline.WARMUP_OUTPUT_LEN for w in warm[:n])  # 256 capped
    for w, r in zip(warm[n:], sharegpt.requests, strict=True):
        assert w.output_len == min(r.output_len, offline.WARMUP_OUTPUT_LEN)


@pytest.mark.slow
def test_cli_on_a_dummy_tiny_model(
    offline: ModuleType, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "offline.json"
    args = ["--shape", "tiny", "--tokenizer", str(tiny_llama_dir), "--device", "cpu"]
    # Seed 208 draws two short ShareGPT-like requests (31 and 28 output tokens).
    args += ["--workloads", "sharegpt", "--scale", "0.002", "--seed", "208", "--json", str(out)]
    args += ["--host-stacks", "0", "1000", "--repeat", "2"]
    assert offline.main(args) == 0
    result = json.loads(out.read_text())
    expected = offline.sharegpt_workload(0.002, 208).requests
    assert len(expected) == 2
    # Two runs a mode on one engine each; the ratio is of the modes' medians.
    assert [(r["radix"], r["run"]) for r in result["rows"]] == [
        ("on", 0),
        ("on", 1),
        ("off", 0),
        ("off", 1),
    ]
    on, off = (
        [r["total_throughput"] for r in result["rows"] if r["radix"] == mode]
        for mode in ("on", "off")
    )
    assert result["radix_on_over_off"]["sharegpt"] == pytest.approx(
        (on[0] + on[1]) / (off[0] + off[1])
    )
    for row in result["rows"]:
        assert row["completed"] == 2
        assert row["input_tokens"] == sum(r.prompt_len for r in expected)
        assert row["output_tokens"] == sum(r.output_len for r in expected)
        # The host's stacks over every step: the engine's step on the stack.
        head, *functions = row["host_stacks"]
        assert re.fullmatch(r"\d+ samples; share on the stack / innermost", head)
        _assert_step_leads(functions)
        # And over the steps whose host took longest on its own: the first line names them.
        named, head, *functions = row["host_stacks_slowest_steps"]
        assert re.fullmatch(r"steps \d+ \([\d.]+ ms\)(, \d+ \([\d.]+ ms\)){4}", named)
        assert int(head.split()[0]) <= int(row["host_stacks"][0].split()[0])
        _assert_step_leads(functions)
    assert set(result["radix_on_over_off"]) == {"sharegpt"}


def _assert_step_leads(lines: list[str]) -> None:
    """In a host-stacks report (`  share%  own%  where qualname` lines), Engine.step is on
    the stack in most samples: the window is the step, and only a sample that lands in the
    sampler's own switch around it (a loaded machine) misses it."""
    step = [float(line.split()[0].rstrip("%")) for line in lines if line.endswith(" Engine.step")]
    assert len(step) == 1 and step[0] > 50.0, lines


def test_host_stacks_finds_the_busy_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    host_stacks = importlib.import_module("common.host_stacks")

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def idle_outside_window() -> None:
        busy(0.05)

    def other(seconds: float) -> None:
        busy(seconds)

    sampler = host_stacks.StackSampler(threading.get_ident(), interval_s=0.001)
    switch = sys.getswitchinterval()
    with sampler:
        idle_outside_window()  # not sampled: the sampler is not active
        assert sys.getswitchinterval() == switch
        sampler.active = True
        assert sys.getswitchinterval() == 0.001
        busy(0.2)  # tallied as step 0
        sampler.step = 1
        other(0.1)
        sampler.active = False
        assert sys.getswitchinterval() == switch
    assert set(sampler.by_step) == {0, 1}
    everything, first = sampler.tally(), sampler.tally([0])
    assert first.samples >= 20 and sampler.by_step[1].samples >= 10
    assert everything.samples == first.samples + sampler.by_step[1].samples
    names = {name.rsplit(" ", 1)[-1]: name for name in everything.inclusive}
    busy_name = names["test_host_stacks_finds_the_busy_function.<locals>.busy"]
    other_name = names["test_host_stacks_finds_the_busy_function.<locals>.other"]
    assert everything.inclusive[busy_name] == everything.samples  # on the stack in every sample
    assert first.own[busy_name] >= 0.9 * first.samples  # and mostly the innermost
    assert first.inclusive[other_name] == 0  # step 1's function, not in step 0's samples
    assert sampler.by_step[1].inclusive[other_name] == sampler.by_step[1].samples
    assert not any("idle_outside_window" in name for name in everything.inclusive)
    report = first.report(top=3)
    assert report[0] == f"{first.samples} samples; share on the stack / innermost"
    assert len(report) == 4 and report[1].startswith("  100.0%")
    assert sampler.tally([7]).report() == ["no samples"]


def test_gpu_busy_counts_overlapping_kernels_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PROBES_DIR))
    gpu_busy = importlib.import_module("gpu_busy")
    # Kernels 0-10 and 5-12 overlap (7 busy past 5), a gap to 20, then 20-25: busy 17 of 25.
    assert gpu_busy.busy_and_span([(20, 25), (0, 10), (5, 12)]) == (17.0, 25.0)
    assert gpu_busy.busy_and_span([(3, 4)]) == (1.0, 1.0)
    assert gpu_busy.busy_and_span([]) == (0.0, 0.0)
    if not torch.cuda.is_available():
        assert gpu_busy.main(["--at", "1"]) == 2  # refuses cleanly without CUDA


def test_gpu_busy_sums_idle_gaps_by_their_neighbours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PROBES_DIR))
    gpu_busy = importlib.import_module("gpu_busy")
    # a 0-10, b 12-20 (gap 2 after a), c 15-30 overlaps b, a 31-40 (gap 1 after c),
    # b 45-50 (gap 5 after a): the gaps are charged to the activity that ended last.
    events = [(12, 20, "b"), (0, 10, "a"), (15, 30, "c"), (31, 40, "a"), (45, 50, "b")]
    lines = gpu_busy.idle_gaps(events)
    assert len(lines) == 2  # two pairs: a -> b (twice), c -> a
    assert lines[0].endswith("a  ->  b") and "in     2 gaps" in lines[0]  # 2 + 5 = 7 us
    assert lines[0].startswith("   0.01 ms")
    assert lines[1].endswith("c  ->  a") and "in     1 gaps" in lines[1]


def test_gpu_busy_lists_longest_gaps_and_cuts_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PROBES_DIR))
    gpu_busy = importlib.import_module("gpu_busy")
    # Step 1: gemm 0-4000, copy to host 4000-4100; a 900-us gap; step 2: gemm 5000-7000,
    # attn 7000-9000 with a 3000-us gap after it, gemm 12000-13000, its copy 13000-13100.
    events = [
        (7000, 9000, "attn"),
        (0, 4000, "gemm"),
        (4000, 4100, "Memcpy DtoH (Device -> Pinned)"),
        (5000, 7000, "gemm"),
        (12000, 13000, "gemm"),
        (13000, 13100, "Memcpy DtoH (Device -> Pinned)"),
    ]
    lines = gpu_busy.longest(events, 2)
    assert lines[0] == "gap    3.00 ms at      9.0 ms: attn  ->  gemm"
    assert lines[1] == "gap    0.90 ms at      4.1 ms: Memcpy DtoH (Device -> Pinned)  ->  gemm"
    assert lines[2] == "ran    4.00 ms at      0.0 ms: gemm"
    assert lines[3].startswith("ran    2.00 ms at      5.0 ms: ")
    assert len(lines) == 4
    steps = gpu_busy.per_step(events, 1)
    assert steps == [
        "piece 0: span 4.10 ms, busy 4.10: gemm 4.00",
        "piece 1: span 8.10 ms, busy 5.10: gemm 3.00",
    ]


def test_gpu_clocks_lines_slow_steps_up_with_samples(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(PROBES_DIR))
    gpu_clocks = importlib.import_module("gpu_clocks")
    start = datetime(2026, 11, 27, 23, 0, 0).timestamp()
    # Four mixed steps of one shape (the third twice as long on the device), two decode
    # steps; the run starts at `start` and submits for 0.1 s.
    series = [
        (0.07, 2048, 480, 0.01, 0.07, 0.0),
        (0.07, 2048, 480, 0.01, 0.07, 0.0),
        (0.14, 2048, 480, 0.0, 0.14, 0.0),
        (0.07, 2048, 480, 0.01, 0.07, 0.0),
        (0.02, 0, 512, 0.01, 0.02, 0.0),
        (0.02, 0, 512, 0.01, 0.02, 0.0),
    ]
    row = {
        "workload": "shared-prefix",
        "radix": "on",
        "started_unix": start,
        "submit_s": 0.1,
        "step_series": series,
    }
    # A sample every 20 ms, 5 ms off the steps' bounds; during the slow step (0.24-0.38 s)
    # the clock drops to 1400 MHz under the software power cap.
    lines = []
    for k in range(30):
        t = 0.005 + k * 0.02
        slow = 0.24 < t < 0.38
        stamp = datetime.fromtimestamp(start + t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        lines.append(
            f"{stamp}, {1400 if slow else 1980}, 2619, {700 if slow else 620}.5, 60, "
            f"{'0x0000000000000004' if slow else '0x0000000000000000'}"
        )
    lines.insert(3, "[Not Supported], 1, 2, 3, 4, 0x0")  # skipped
    samples = gpu_clocks.parse_samples("\n".join(lines))
    assert len(samples) == 30
    report = gpu_clocks.align(row, samples)
    assert len(report) == 4, report
    assert report[1].startswith("  step 2 (2048 + 480 rows): device 140.0 ms against 70.0;")
    assert (
        "host busy 140.0 ms, waited 0.0; SM MHz 1400 1400 1400 1400 1400 1400 1400; W 700 "
        in report[1]
    )
    assert report[1].endswith("sw power cap")
    assert report[2].startswith("  all steps: 20 samples, SM 1980 MHz")
    assert report[3].startswith("  slow steps: 7 samples, SM 1400 MHz, 700 W")
    assert gpu_clocks.reason_names(0x84) == "sw power cap+hw power brake"
    # From the command line, and a CPU run (no device times) said as such.
    csv_path, run_path = tmp_path / "smi.csv", tmp_path / "run.json"
    csv_path.write_text("\n".join(lines))
    cpu_row = dict(row, radix="off", step_series=[s[:4] for s in series])
    run_path.write_text(json.dumps({"rows": [row, cpu_row]}))
    assert gpu_clocks.main(["--samples", str(csv_path), "--run", str(run_path)]) == 0
    out = capsys.readouterr().out
    assert "step 2 (2048 + 480 rows)" in out
    assert "shared-prefix radix off: no device times (not a CUDA run)" in out


def test_gpu_clocks_refuses_to_sample_without_nvidia_smi(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(PROBES_DIR))
    gpu_clocks = importlib.import_module("gpu_clocks")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi there
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    assert gpu_clocks.main(["--samples", str(tmp_path / "smi.csv"), "--", *command]) == 2
    assert not marker.exists()  # the command did not run unsampled


def test_kernel_builds_counts_each_build_in_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """KernelBuilds hooks Triton's build hooks (called here as Triton calls them: before
    and after a build), tags each build with the step it came in, chains the hooks that
    were set and sets them back."""
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    step_probes = importlib.import_module("common.step_probes")
    seen: list[str] = []

    def earlier_before(**kwargs: object) -> None:
        seen.append("before")

    def earlier_after(**kwargs: object) -> None:
        seen.append("after")

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", earlier_before)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", earlier_after)

    class Fn:
        def __init__(self, name: str) -> None:
            self.name = name

    def build(name: str, seconds: float) -> None:
        assert knobs.runtime.jit_cache_hook(key=name, fn=Fn(name)) is None  # do build
        time.sleep(seconds)
        knobs.runtime.jit_post_compile_hook(key=name, fn=Fn(name))

    with step_probes.KernelBuilds() as builds:
        builds.step = 3
        build("_decode_kernel", 0.02)
        build("_gemv_kernel", 0.0)
        builds.step = 7
        build("_argmax_kernel", 0.0)
    assert knobs.runtime.jit_cache_hook is earlier_before
    assert knobs.runtime.jit_post_compile_hook is earlier_after
    assert seen == ["before", "after"] * 3
    assert [(step, name) for step, name, _ in builds.builds] == [
        (3, "_decode_kernel"),
        (3, "_gemv_kernel"),
        (7, "_argmax_kernel"),
    ]
    by_step = builds.by_step()
    assert by_step.keys() == {3, 7} and by_step[3][0] == 2 and by_step[7][0] == 1
    assert by_step[3][1] >= 0.02 > builds.builds[1][2]
