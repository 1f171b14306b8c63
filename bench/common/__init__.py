"""What the benchmarks share, so that no benchmark imports another: model shapes and the
folders that load them with random weights, device timers (a copy's bandwidth, a
matmul's rate, a CUDA-event median), and the stack helpers the load tests meter a phase
with. The benchmarks run as scripts from bench/ and import this as `common`; the probes
under lab/probes put bench/ on their path to do the same.

Beside it: `common.roofline` (the floor of an offline run), `common.step_probes` (what
bench/offline.py measures about each engine step), `common.host_stacks` (a Python
stack sampler for one thread) and `common.faults` (bench/soak.py's fault mode: kills, the
resuming clients, what became of each request).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixserve.infra import Infra
    from radixserve.stack import Stack

# Model shapes (config.json contents) the benchmarks build with random weights.

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_LLAMA: dict[str, Any] = {
    **{k: v for k, v in LLAMA_31_8B.items() if k != "rope_scaling"},
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 49152,  # SmolLM2's tokenizer (the embedded model's)
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "tiny": TINY_LLAMA}
VOCAB = 128256  # Llama 3's vocabulary: the logits' width of the sampler benches


def default_tokenizer_dir() -> Path:
    """RADIXSERVE_TEST_TOKENIZER_DIR where set (a lent GPU), else the embedded model's."""
    source = os.environ.get("RADIXSERVE_TEST_TOKENIZER_DIR")
    if source:
        return Path(source)
    from radixserve.model_files.paths import resolve_model_path

    return Path(resolve_model_path(None))


def write_model_folder(tokenizer_dir: Path, shape: dict[str, Any]) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="one-batch-"))
    (folder / "config.json").write_text(json.dumps(shape))
    for item in tokenizer_dir.iterdir():
        if item.is_file() and item.name != "config.json" and not item.name.endswith(".safetensors"):
            (folder / item.name).write_bytes(item.read_bytes())
    return folder


def dummy_model_folder(tokenizer_dir: Path, shape_name: str) -> Path:
    """A folder with `shape_name`'s config (vocabulary cut to the tokenizer's, so every
    sampled id decodes) and the tokenizer's files: load it with load_format dummy."""
    from transformers import AutoTokenizer

    shapes = {"llama-8b": LLAMA_31_8B, "tiny": TINY_LLAMA}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = {
        **shapes[shape_name],
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    return write_model_folder(tokenizer_dir, shape)


def dummy_engine(folder: Path, device: str, backend: str, **options: Any) -> Any:
    """An Engine over `folder`'s shape with random weights (load_format dummy): bfloat16
    on CUDA, float32 on the CPU. radixserve is imported here, once the caller has set
    its environment (bench/start_up.py's empty kernel caches)."""
    from radixserve import Engine

    return Engine(
        model_path=str(folder),
        load_format="dummy",
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        attention_backend=backend,
        **options,
    )


# Device timers.


def sync() -> None:
    torch.cuda.synchronize()


def measure_bandwidth(gib: float = 4.0, repeats: int = 20) -> float:
    """Bytes read + written per second of a large device-to-device copy (median)."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        sync()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n * 2 / statistics.median(times[3:])


def measure_matmul(size: int = 8192, repeats: int = 20) -> float:
    """bf16 FLOP/s of a large square matmul (median)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        sync()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times[3:])


def time_ms(fn: Callable[[], object], reps: int) -> float:
    """The median of `reps` calls of `fn` on the device (CUDA events), after three."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# The service stack, metered by phase (bench/overhead.py, online.py, soak.py).


def start_local_stack(
    infra: Infra,
    name: str,
    port: int,
    model_dir: Path,
    served: str,
    worker_args: list[str],
    workers: int = 1,
) -> Stack:
    """One stack on this host over `infra`'s NATS and Redis, started (the six services as
    `radixserve up` starts them, `workers` workers; metrics from `port` + 100, logs in a
    fresh temporary folder). The caller waits for it to be healthy and stops it."""
    from radixserve.stack import Stack, StackSpec

    spec = StackSpec(
        nats_url=infra.nats_url,
        redis_url=infra.redis_url,
        subject_prefix=f"bench-{name}-{os.getpid()}",
        host="127.0.0.1",
        port=port,
        workers=workers,
        model_dir=model_dir,
        served_model_name=served,
        worker_args=worker_args,
        tokenizer_args=[],
        log_dir=Path(tempfile.mkdtemp(prefix=f"radixserve-{name}-")),
        metrics_port_base=port + 100,
        # The credentials of the NATS and Redis `infra` started (None for given URLs).
        nats_users=infra.nats_users,
        redis_acl=infra.redis_acl,
    )
    stack = Stack(spec, say=lambda text: print(text, file=sys.stderr))
    stack.start()
    return stack


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_counters(metrics_url: str) -> dict[str, float]:
    """The worker's step-time and batch-size histograms' sums and counts (/metrics)."""
    import httpx

    wanted: tuple[str, ...] = ("step_duration_seconds_sum", "step_duration_seconds_count")
    wanted += ("batch_size_sum", "batch_size_count")
    found = dict.fromkeys(wanted, 0.0)
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        name, value = line.partition("{")[0].split(" ")[0], line.rsplit(" ", 1)[-1]
        for key in wanted:
            if name.endswith(key):
                found[key] += float(value)
    return found


class PhaseMeter:
    """Over one phase: each service's CPU seconds per wall second (a Python service near
    1.0 is bound by the thread holding its GIL; the client processes are not counted)
    and per output token (us), and the worker's steps: how many, their mean time and
    batch."""

    def __init__(self, stack: Stack, worker_metrics_url: str) -> None:
        self.pids = {s.name: s.process.pid for s in stack.services if s.process.pid is not None}
        self.url = worker_metrics_url
        self.start = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self.counters = worker_counters(self.url)
        self.started = time.perf_counter()

    def report(self, tokens: int) -> dict[str, Any]:
        wall = time.perf_counter() - self.started
        used = {name: cpu_seconds(pid) - self.start[name] for name, pid in self.pids.items()}
        now = worker_counters(self.url)
        d = {key: now[key] - self.counters[key] for key in now}
        steps = d["step_duration_seconds_count"]
        return {
            "cpu_shares": {name: round(s / wall, 2) for name, s in used.items()},
            "cpu_us_per_token": {
                name: round(1e6 * s / max(tokens, 1), 1) for name, s in used.items()
            },
            "worker_steps": int(steps),
            "worker_step_ms": round(1e3 * d["step_duration_seconds_sum"] / max(steps, 1), 2),
            "worker_batch": round(d["batch_size_sum"] / max(d["batch_size_count"], 1), 1),
            "worker_busy": round(d["step_duration_seconds_sum"] / wall, 2),
        }
