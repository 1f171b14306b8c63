"""Decode step time of FP8 against bf16 weights, and each against its roofline.

A Llama-3.1-8B-shaped model with random weights (`load_format="dummy"`; FP8 by
`quantization="fp8"`: every projection quantized per output row on load, the
embeddings and the head kept in bf16) decodes `--output-len` steps back to back at each
batch size, CUDA graphs on, timed with one sync at the end (bench/one_batch.py's way).
The roofline of a step is the bytes it must read over the device's copy bandwidth: the
weights a step streams (every parameter but the embedding table, of which it reads a
row per token) plus the KV it attends over. Issue 58's targets: at batch 1 a step within
1.15x the FP8 roofline; at batch 64 roofline / step >= 0.75.

    python bench/fp8.py --tokenizer DIR [--batch-sizes 1 64 --json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import LLAMA_31_8B, measure_bandwidth, sync, write_model_folder

TARGET_BS1_X_ROOFLINE = 1.15
TARGET_BS64_ROOFLINE_OVER_STEP = 0.75


def streamed_weight_bytes(model: torch.nn.Module, batch_size: int) -> int:
    """Bytes of the weights one decode step reads: all but the embedding table, of which
    each token's row (a tied head streams the table itself and counts it whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if model.config.tie_word_embeddings:
        return total
    row_bytes = embed.shape[1] * embed.element_size()
    return total - embed.numel() * embed.element_size() + batch_size * row_bytes


def run(
    folder: Path, quantization: str | None, args: argparse.Namespace, bandwidth: float
) -> list[dict[str, Any]]:
    from radixserve import Engine

    max_bs = max(args.batch_sizes)
    started = time.perf_counter()
    engine = Engine(
        model_path=str(folder),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        quantization=quantization,
        max_running_requests=max_bs,
        context_length=args.input_len + args.output_len + 8,
        chunked_prefill_size=-1,
        max_prefill_tokens=max_bs * args.input_len + 1,
        disable_radix_cache=True,
        mem_fraction_static=args.mem_fraction_static,
        **json.loads(args.engine_args),
    )
    label = quantization or "bf16"
    print(f"{label}: engine up in {time.perf_counter() - started:.1f} s", flush=True)
    model = engine.runner.model
    c = engine.runner.model_config
    kv_per_token = 2 * c.num_hidden_layers * engine.runner.local_kv_heads * c.head_dim * 2
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs in args.batch_sizes:
        prompts = [
            torch.randint(10, c.vocab_size, (args.input_len,), generator=gen).tolist()
            for _ in range(bs)
        ]
        params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
        for warm in (True, False):
            for p in prompts:
                engine.submit(p, params)
            engine.step()  # the prefill
            sync()
            steps = args.output_len - 1
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync()
            step_s = (time.perf_counter() - t0) / steps
            while engine.has_work():
                engine.step()
            if warm:
                continue
        weights = streamed_weight_bytes(model, bs)
        kv = bs * (args.input_len + args.output_len / 2) * kv_per_token
        roofline_s = (weights + kv) / bandwidth
        rows.append(
            {
                "weights": label,
                "batch_size": bs,
                "decode_step_ms": step_s * 1e3,
                "roofline_ms": roofline_s * 1e3,
                "step_x_roofline": step_s / roofline_s,
                "roofline_over_step": roofline_s / step_s,
                "weight_gib_read": weights / 2**30,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    engine.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with tokenizer files")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a quick look")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--engine-args", default="{}", help="more Engine options, a JSON object")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    shape = dict(LLAMA_31_8B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    bandwidth = measure_bandwidth()
    torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    folder = write_model_folder(args.tokenizer, shape)
    rows = []
    for quantization in (None, "fp8"):
        rows += run(folder, quantization, args, bandwidth)
        gc.collect()  # the last engine's memory must be back before the next one
        torch.cuda.empty_cache()
    print(
        f"\n{'weights':<8} {'bs':>4} {'step ms':>8} {'roofline':>8} {'x roof':>6} {'roof/step':>9}"
    )
    for r in rows:
        print(
            f"{r['weights']:<8} {r['batch_size']:>4} {r['decode_step_ms']:>8.3f} "
            f"{r['roofline_ms']:>8.3f} {r['step_x_roofline']:>6.2f} {r['roofline_over_step']:>9.2f}"
        )
    by = {(r["weights"], r["batch_size"]): r for r in rows}
    verdicts = []
    if ("fp8", 1) in by:
        fp8_1 = by[("fp8", 1)]
        verdicts.append(
            f"batch 1: FP8 step {fp8_1['step_x_roofline']:.2f}x its roofline "
            f"(target <= {TARGET_BS1_X_ROOFLINE}); FP8 / bf16 step "
            f"{fp8_1['decode_step_ms'] / by[('bf16', 1)]['decode_step_ms']:.2f}"
        )
    if ("fp8", 64) in by:
        verdicts.append(
            f"batch 64: FP8 roofline / step {by[('fp8', 64)]['roofline_over_step']:.2f} "
            f"(target >= {TARGET_BS64_ROOFLINE_OVER_STEP})"
        )
    print("\n".join(verdicts))
    if args.json:
        result = {"device": device, "torch": torch.__version__, "bandwidth_bytes_s": bandwidth}
        args.json.write_text(json.dumps({**result, "rows": rows, "verdicts": verdicts}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
