"""The GPU's clocks, power and throttle reasons through an offline run, beside its steps.

Samples `nvidia-smi` while a command runs, then lines the samples up with the steps of
a `bench/offline.py --json` file: each step's start on the wall clock is its run's
`started_unix` plus its submit time plus the steps before it. A step is slow when its
device time (offline.py's `DeviceClock`) is over SLOW times the median of the steps of
its shape (prompt tokens, decode rows). For each run it prints the slow steps with the
SM clock, power, temperature and throttle reasons sampled during them, and the median
SM clock and power in slow steps against all steps, and the host's own time in them
(its step time less its wait for the device): a slow step whose host never waited was
the host's, one at low clocks under a power cap the device's.

    python lab/probes/gpu_clocks.py --samples smi.csv -- python bench/offline.py \\
        --workloads shared-prefix --radix on --json run.json
    python lab/probes/gpu_clocks.py --samples smi.csv --run run.json

Run both on the GPU machine (nvidia-smi writes local time).
"""

from __future__ import annotations

import argparse
import bisect
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
# The throttle reasons' field, by its older name and the newer drivers' one.
REASON_FIELDS = ("clocks_throttle_reasons.active", "clocks_event_reasons.active")
SLOW = 1.3
# nvidia-smi's clocks_throttle_reasons bits.
REASONS = {
    0x1: "idle",
    0x2: "app clocks",
    0x4: "sw power cap",
    0x8: "hw slowdown",
    0x10: "sync boost",
    0x20: "sw thermal",
    0x40: "hw thermal",
    0x80: "hw power brake",
}


@dataclass(frozen=True)
class Sample:
    at: float  # seconds since the epoch
    sm_mhz: float
    mem_mhz: float
    power_w: float
    temp_c: float
    reasons: int


def reason_names(mask: int) -> str:
    names = [name for bit, name in REASONS.items() if mask & bit]
    return "+".join(names) or "none"


def parse_samples(text: str) -> list[Sample]:
    """`nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits` lines; others skipped."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 6:
            continue
        try:
            at = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            sm, mem, power, temp = (float(f) for f in fields[1:5])
            reasons = int(fields[5], 16)
        except ValueError:
            continue
        samples.append(Sample(at, sm, mem, power, temp, reasons))
    return sorted(samples, key=lambda s: s.at)


def during(samples: list[Sample], start: float, end: float) -> list[Sample]:
    """The samples taken in [start, end], else the one nearest before start."""
    times = [s.at for s in samples]
    lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
    if lo < hi:
        return samples[lo:hi]
    return [samples[lo - 1]] if lo > 0 else samples[:1]


def align(row: dict[str, Any], samples: list[Sample]) -> list[str]:
    """The report for one run (a row of offline.py's JSON with its `step_series`)."""
    series = row["step_series"]
    if not series or len(series[0]) < 6:
        return [f"{row['workload']} radix {row['radix']}: no device times (not a CUDA run)"]
    at = row["started_unix"] + row["submit_s"]
    spans = []
    for seconds, *_ in series:
        spans.append((at, at + seconds))
        at += seconds
    by_shape: dict[tuple[int, int], list[float]] = defaultdict(list)
    for _, prefill, rows, _, device_s, _ in series:
        by_shape[(prefill, rows)].append(device_s)
    medians = {k: statistics.median(v) for k, v in by_shape.items() if len(v) > 1}
    lines = [f"{row['workload']} radix {row['radix']}: {len(series)} steps"]
    slow_samples: list[Sample] = []
    for i, (seconds, prefill, rows, wait_s, device_s, _) in enumerate(series):
        median = medians.get((prefill, rows))
        if median is None or device_s <= SLOW * median:
            continue
        seen = during(samples, *spans[i])
        slow_samples += seen
        clocks = " ".join(f"{s.sm_mhz:.0f}" for s in seen)
        power = " ".join(f"{s.power_w:.0f}" for s in seen)
        reasons = sorted({reason_names(s.reasons) for s in seen})
        lines.append(
            f"  step {i} ({prefill} + {rows} rows): device {1e3 * device_s:.1f} ms against "
            f"{1e3 * median:.1f}; host busy {1e3 * (seconds - wait_s):.1f} ms, waited "
            f"{1e3 * wait_s:.1f}; SM MHz {clocks}; W {power}; {', '.join(reasons)}"
        )
    seen_all = during(samples, spans[0][0], spans[-1][1])
    for name, group in (("all steps", seen_all), ("slow steps", slow_samples)):
        if group:
            counts: dict[str, int] = defaultdict(int)
            for s in group:
                counts[reason_names(s.reasons)] += 1
            lines.append(
                f"  {name}: {len(group)} samples, SM {statistics.median(s.sm_mhz for s in group):.0f} "
                f"MHz, {statistics.median(s.power_w for s in group):.0f} W, "
                f"{max(s.temp_c for s in group):.0f} C at most; reasons "
                + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            )
    return lines


def sample_while(command: list[str], out: Path, interval_ms: int) -> int:
    """Run `command` with nvidia-smi writing samples to `out`; the command's exit code
    (2, without running it, where there is no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        print("gpu_clocks: no nvidia-smi on this machine", file=sys.stderr)
        return 2
    with out.open("w") as f:
        for reasons in REASON_FIELDS:
            f.seek(0)
            f.truncate()
            smi = subprocess.Popen(
                [
                    "nvidia-smi",
                    f"--query-gpu={FIELDS},{reasons}",
                    "--format=csv,noheader,nounits",
                    f"--loop-ms={interval_ms}",
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
            )
            time.sleep(1.0)
            if smi.poll() is None:
                break
        else:
            print(f"gpu_clocks: nvidia-smi exited ({smi.returncode}); see {out}", file=sys.stderr)
        try:
            return subprocess.call(command)
        finally:
            if smi.poll() is None:
                smi.terminate()
                smi.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=Path, required=True, help="nvidia-smi's CSV")
    ap.add_argument("--run", type=Path, help="an offline.py --json file to line up with")
    ap.add_argument("--interval-ms", type=int, default=50)
    args = ap.parse_args(argv)
    if command:
        return sample_while(command, args.samples, args.interval_ms)
    if args.run is None:
        ap.error("give a command after -- to sample, or --run to line samples up")
    samples = parse_samples(args.samples.read_text())
    if not samples:
        print(f"gpu_clocks: no samples in {args.samples}", file=sys.stderr)
        return 1
    for row in json.loads(args.run.read_text())["rows"]:
        print("\n".join(align(row, samples)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
