"""Prefill and decode latency of one batch, against the device's measured roofline.

Like SGLang's bench_one_batch: a Llama-3.1-8B-shaped model with random bf16 weights is
built on the device (no download: `load_format="dummy"`, the folder holds only
config.json and tokenizer files), then for each batch size B: one prefill of B
prompts of `--input-len` tokens, then `--output-len` decode steps, each timed with a
device sync. The same run measures the device's read bandwidth (a large
device-to-device copy) and bf16 matmul rate, and reports each figure as a ratio to
its roofline:

- decode step: (weight bytes + KV bytes read in the step) / bandwidth;
- prefill: matmul FLOPs (2 x params x tokens, plus attention) / matmul rate.

    python bench/one_batch.py --tokenizer DIR [--batch-sizes 1 8 32 64 --backends torch triton]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

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


def write_model_folder(tokenizer_dir: Path, shape: dict[str, Any]) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="one-batch-"))
    (folder / "config.json").write_text(json.dumps(shape))
    for item in tokenizer_dir.iterdir():
        if item.is_file() and item.name != "config.json" and not item.name.endswith(".safetensors"):
            (folder / item.name).write_bytes(item.read_bytes())
    return folder


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def run_backend(
    folder: Path, backend: str, args: argparse.Namespace, bandwidth: float, matmul: float
) -> list[dict[str, Any]]:
    from radixserve import Engine

    max_bs = max(args.batch_sizes)
    engine = Engine(
        model_path=str(folder),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        attention_backend=backend,
        max_running_requests=max_bs,
        context_length=args.input_len + args.output_len + 8,
        chunked_prefill_size=-1,
        max_prefill_tokens=max_bs * args.input_len + 1,
        disable_radix_cache=True,
        mem_fraction_static=0.88,
    )
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = param_count(model)
    c = engine.runner.model_config
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs in args.batch_sizes:
        prompts = [
            torch.randint(10, c.vocab_size, (args.input_len,), generator=gen).tolist()
            for _ in range(bs)
        ]
        params_d = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
        for warm in (True, False):
            rids = [engine.submit(p, params_d) for p in prompts]
            sync()
            t0 = time.perf_counter()
            engine.step()  # the whole batch's prefill (one chunk: no chunking here)
            sync()
            prefill_s = time.perf_counter() - t0
            steps = []
            for _ in range(args.output_len - 1):
                t0 = time.perf_counter()
                engine.step()
                sync()
                steps.append(time.perf_counter() - t0)
            while engine.has_work():
                engine.step()
            assert engine.num_tracked() == 0, rids
            if warm:
                continue
        decode_s = statistics.median(steps)
        mean_ctx = args.input_len + args.output_len / 2
        decode_bytes = weight_bytes + bs * mean_ctx * kv_per_token
        decode_roofline = decode_bytes / bandwidth
        tokens = bs * args.input_len
        attn_flops = (
            4
            * c.num_hidden_layers
            * c.num_attention_heads
            * c.head_dim
            * bs
            * (args.input_len**2 / 2)
        )
        prefill_flops = 2 * params * tokens + attn_flops
        prefill_roofline = prefill_flops / matmul
        rows.append(
            {
                "backend": backend,
                "batch_size": bs,
                "input_len": args.input_len,
                "prefill_ms": prefill_s * 1e3,
                "prefill_vs_matmul_rate": prefill_roofline / prefill_s,
                "decode_step_ms": decode_s * 1e3,
                "decode_roofline_ms": decode_roofline * 1e3,
                "decode_x_roofline": decode_s / decode_roofline,
                "decode_tok_s": bs / decode_s,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    engine.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with tokenizer files")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a quick look")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    shape = dict(LLAMA_31_8B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    bandwidth = measure_bandwidth()
    matmul = measure_matmul()
    torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    print(
        f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s"
    )
    folder = write_model_folder(args.tokenizer, shape)
    rows = []
    for backend in args.backends:
        rows += run_backend(folder, backend, args, bandwidth, matmul)
        torch.cuda.empty_cache()
    result = {
        "device": device,
        "torch": torch.__version__,
        "bandwidth_bytes_s": bandwidth,
        "matmul_flop_s": matmul,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(
        f"\n{'backend':<8} {'bs':>4} {'prefill ms':>10} {'vs matmul':>9} "
        f"{'decode ms':>9} {'roofline':>8} {'x roof':>6}"
    )
    for r in rows:
        print(
            f"{r['backend']:<8} {r['batch_size']:>4} {r['prefill_ms']:>10.1f} "
            f"{r['prefill_vs_matmul_rate']:>9.2f} {r['decode_step_ms']:>9.2f} "
            f"{r['decode_roofline_ms']:>8.2f} {r['decode_x_roofline']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
