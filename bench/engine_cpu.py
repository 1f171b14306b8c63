"""Engine throughput on the CPU against Hugging Face generate, side by side in one run.

SmolLM2-135M-Instruct (the embedded model), N requests of P prompt tokens and O output
tokens each (defaults 32 x 256 + 128). Measures output tokens/s of:
  - radixserve's Engine, all requests submitted at once (continuous batching);
  - HF `generate`, one request at a time;
  - HF `generate`, all requests in one left-padded batch.
Greedy, ignore EOS (min_new_tokens) so every request produces exactly O tokens.

    python bench/engine_cpu.py [--requests 32 --prompt-len 256 --output-len 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date

import torch
from transformers import AutoModelForCausalLM

from radixserve import Engine


def make_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def bench_engine(engine: Engine, prompts: list[list[int]], out_len: int) -> float:
    _sync()
    params = {"max_new_tokens": out_len, "min_new_tokens": out_len, "temperature": 0.0}
    engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    _sync()
    elapsed = time.perf_counter() - t0
    assert isinstance(outs, list)
    assert all(len(o["output_ids"]) == out_len for o in outs)
    return len(prompts) * out_len / elapsed


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _hf_generate(model: torch.nn.Module, batch: list[list[int]], out_len: int) -> None:
    x = torch.tensor(batch, device=model.device)  # equal lengths: no padding needed
    model.generate(  # type: ignore[operator]
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=out_len,
        min_new_tokens=out_len,
        do_sample=False,
        pad_token_id=0,
    )


def bench_hf_one_at_a_time(model: torch.nn.Module, prompts: list[list[int]], out_len: int) -> float:
    _sync()
    t0 = time.perf_counter()
    for ids in prompts:
        _hf_generate(model, [ids], out_len)
    _sync()
    return len(prompts) * out_len / (time.perf_counter() - t0)


def bench_hf_batched(model: torch.nn.Module, prompts: list[list[int]], out_len: int) -> float:
    _sync()
    t0 = time.perf_counter()
    _hf_generate(model, prompts, out_len)
    _sync()
    return len(prompts) * out_len / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="engine repeats (median reported)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-hf-single", action="store_true")
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cpu")
    # "auto" is what a user gets: bfloat16 on a CPU with bfloat16 instructions (the
    # embedded model is a bfloat16 one), float32 elsewhere; HF runs the same dtype.
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    engine = Engine(model_path=args.model, device=args.device, dtype=args.dtype)
    prompts = make_prompts(args.requests, args.prompt_len, engine.runner.vocab_size)
    bench_engine(engine, prompts[:2], 4)  # warm-up
    engine_tps = statistics.median(
        bench_engine(engine, prompts, args.output_len) for _ in range(args.repeats)
    )

    model = AutoModelForCausalLM.from_pretrained(
        engine.runner.model_path, dtype=engine.runner.dtype
    )
    model = model.to(engine.runner.device).eval()
    with torch.inference_mode():
        hf_batched = bench_hf_batched(model, prompts, args.output_len)
        hf_single = (
            None if args.skip_hf_single else bench_hf_one_at_a_time(model, prompts, args.output_len)
        )

    result = {
        "date": date.today().isoformat(),
        "machine": (
            torch.cuda.get_device_name(engine.runner.device)
            if engine.runner.device.type == "cuda"
            else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
        ),
        "dtype": str(engine.runner.dtype),
        "torch": torch.__version__,
        "workload": f"{args.requests} req x {args.prompt_len} prompt + {args.output_len} output, greedy",
        "engine_tok_s": round(engine_tps, 1),
        "hf_batched_tok_s": round(hf_batched, 1),
        "hf_one_at_a_time_tok_s": None if hf_single is None else round(hf_single, 1),
        "engine_vs_hf_one_at_a_time": None
        if hf_single is None
        else round(engine_tps / hf_single, 2),
        "engine_vs_hf_batched": round(engine_tps / hf_batched, 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
