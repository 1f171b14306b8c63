"""A cached mixed step's attention, one layer: the decoders' cascade beside the prompts'
prefill, run several ways.

In the shared-prefix run's mixed steps (radix on) each layer runs FlashInfer's FA2
prefill over the step's prompt tokens on the current stream and, on a side stream beside
it, the cascade of its ~450 decoders (the shared-prefix kernel, then the suffix decode).
A profile of the second wave (docs/performance.md, 2026-11-28) put the cascade at
13-15 ms a step and FA2 at 6-8, the cascade reading at an estimated 50-60% of the copy
rate beside FA2. This times the layer's attention ways, on the engine's FlashInfer backend
and its tables (one pass built as tests/helpers/attention_passes.py builds them):

- `side`: the engine's (FA2 here, the cascade on a side stream, forked and joined by
  `Stream.wait_stream`, which makes an event each call);
- `side-events`: the same with two events made once (the host's launch time differs);
- `side-high`: that with the side stream at high priority;
- `swap`: the cascade here, FA2 on the side stream;
- `serial`: FA2 then the cascade on one stream; `cascade-first`: the other order;
- `fa2`, `cascade`: each alone (their sum against the ways above is what running them
  together saves).

Each way runs the layer `--repeat` times back to back (alternating the pool's two
layers), timed with CUDA events (and the host's time to launch them), rounds of all
ways alternating, median per way. Every way's output must equal `side`'s bit for bit
(the same kernels on the same inputs).

    python lab/probes/mixed_attention.py [--decoders 448 --group 16 --suffix 128 384
        --step question|prefix --repeat 32 --rounds 5]

CUDA with FlashInfer only.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.helpers

from radixserve.engine.attention.cascade import CascadeDecode
from radixserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend
from tests.helpers.attention_passes import Pass, make_pass, share_prefixes

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
PREFIX = 2048  # the workload's system prompt
WAYS = ("side", "side-events", "side-high", "swap", "serial", "cascade-first", "fa2", "cascade")


def build(
    decoders: int,
    group: int,
    suffix: tuple[int, int],
    step: str,
    seed: int,
    device: torch.device | None = None,
) -> Pass:
    """`decoders` one-token requests in groups of `group` over PREFIX-token prefixes, with
    suffixes drawn from `suffix`, then the step's prompts: a new group's 16 questions of
    128 tokens over its cached prefix (`question`) or one 2048-token prompt (`prefix`)."""
    rng = random.Random(seed)
    lens = [PREFIX + rng.randint(*suffix) for _ in range(decoders)]
    if step == "question":
        prompts_prefix, prompts_new = [PREFIX] * 16, [128] * 16
    else:
        prompts_prefix, prompts_new = [0], [2048]
    p = make_pass(
        lens + prompts_prefix,
        [1] * decoders + prompts_new,
        device=device or torch.device("cuda"),
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        seed=seed,
    )
    groups = [
        (PREFIX, list(range(start, min(start + group, decoders))))
        for start in range(0, decoders, group)
        if min(start + group, decoders) - start >= 2
    ]
    share_prefixes(p, groups)
    if step == "question":
        # The questions are one group's, over the prefix its first prompt cached: the
        # same slots (FA2 reads them once per question, mostly from L2).
        table, rows = p.batch.req_to_token, p.batch.req_pool_indices.tolist()[decoders:]
        for row in rows[1:]:
            table[row, :PREFIX] = table[rows[0], :PREFIX]
    return p


def ways(p: Pass) -> dict[str, Callable[[int], torch.Tensor]]:
    """Each way as a function of the layer, over one planned backend."""
    backend = FlashInferAttentionBackend(torch.device("cuda"), torch.bfloat16)
    backend.init_forward_metadata(p.batch)
    for layer in (0, 1):  # stores the new tokens' K/V and plans the prefill wrapper
        backend.forward(p.q, p.k, p.v, layer, p.batch, p.scale)
    step, cascade = backend._pass, backend._cascade
    assert step is not None and step.wrapper is not None and isinstance(cascade, CascadeDecode)
    first, pool, q = step.first, p.batch.kv_pool, p.q
    side, high, other = torch.cuda.Stream(), torch.cuda.Stream(priority=-1), torch.cuda.Stream()
    fork, join = torch.cuda.Event(), torch.cuda.Event()

    def fa2(layer: int, out: torch.Tensor) -> None:
        paged = (pool.k_buffers[layer].unsqueeze(1), pool.v_buffers[layer].unsqueeze(1))
        step.wrapper.run(q[first:], paged, out=out[first:])

    def cas(layer: int, out: torch.Tensor) -> None:
        cascade.forward(
            q[:first], pool.k_buffers[layer], pool.v_buffers[layer], p.scale, out=out[:first]
        )

    def beside(here: Callable, there: Callable, stream: torch.cuda.Stream) -> Callable:
        def run(layer: int) -> torch.Tensor:
            out = torch.empty_like(q)
            main = torch.cuda.current_stream()
            fork.record(main)
            stream.wait_event(fork)
            here(layer, out)
            with torch.cuda.stream(stream):
                there(layer, out)
            join.record(stream)
            main.wait_event(join)
            return out

        return run

    def serial(*parts: Callable) -> Callable:
        def run(layer: int) -> torch.Tensor:
            out = torch.empty_like(q)
            for part in parts:
                part(layer, out)
            return out

        return run

    cascade.prepare(q[:first], KV_HEADS)
    return {
        "side": lambda layer: backend.forward(
            p.q, p.k, p.v, layer, p.batch, p.scale, kv_stored=True
        ),
        "side-events": beside(fa2, cas, side),
        "side-high": beside(fa2, cas, high),
        "swap": beside(cas, fa2, other),
        "serial": serial(fa2, cas),
        "cascade-first": serial(cas, fa2),
        "fa2": serial(fa2),
        "cascade": serial(cas),
    }


def time_way(run: Callable[[int], torch.Tensor], repeat: int) -> tuple[float, float]:
    """(device ms, host ms) a layer over `repeat` layers back to back: the device's from
    CUDA events, the host's the time to launch them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    began = time.perf_counter()
    for i in range(repeat):
        run(i % 2)
    host = time.perf_counter() - began
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat, 1e3 * host / repeat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--decoders", type=int, default=448)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--suffix", type=int, nargs=2, default=[128, 384])
    ap.add_argument("--step", choices=["question", "prefix"], default="question")
    ap.add_argument("--repeat", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    p = build(args.decoders, args.group, tuple(args.suffix), args.step, args.seed)
    runs = ways(p)
    reference = runs["side"](0)
    for name, run in runs.items():
        out = run(0)
        if name in ("fa2", "cascade"):
            first = p.batch.cascade_rows
            rows = slice(first, None) if name == "fa2" else slice(0, first)
            same = torch.equal(out[rows], reference[rows])
        else:
            same = torch.equal(out, reference)
        assert same, f"{name}'s output differs from the engine's"
    times: dict[str, list[float]] = {name: [] for name in runs}
    hosts: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            device_ms, host_ms = time_way(run, args.repeat)
            times[name].append(device_ms)
            hosts[name].append(host_ms)
    print(
        f"{torch.cuda.get_device_name()}: {args.decoders} decoders in groups of {args.group} "
        f"over {PREFIX} + {args.suffix[0]}-{args.suffix[1]} tokens, beside a {args.step} "
        f"step; ms a layer on the device (and on the host to launch it), median of "
        f"{args.rounds} x {args.repeat} layers"
    )
    for name in WAYS:
        print(
            f"  {name:<14} {statistics.median(times[name]):.4f} "
            f"({statistics.median(hosts[name]):.4f})"
        )
    both = statistics.median(times["fa2"]) + statistics.median(times["cascade"])
    print(f"  fa2 + cascade  {both:.4f} (each alone, summed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
