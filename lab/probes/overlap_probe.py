"""Can a decode step run its attention beside its GEMMs? A probe before building it.

A large decode step (the shared-prefix run's ~476 requests) spends about as long in
its GEMMs (compute-bound) as in its attention (memory-bound), one after the other.
NanoFlow-style overlap cuts the batch into two halves and runs one half's attention
while the other half's GEMMs run, on two streams. This times, for 32 layers of the
Llama-3.1-8B shape (the projections through cuBLAS as the engine runs them, attention
as the engine's Triton split-KV decode over `--context` tokens a request; no norms,
activation or rotary), each inside a CUDA graph:

- gemm: the GEMMs alone, the whole batch;  attn: the attention alone;
- seq: both in order, the whole batch (what the engine does today);
- halves: the two halves one after the other on one stream (the cost of cutting);
- free: GEMMs and attention of the whole batch on two streams with no dependency
  between them (an upper bound on what running them together can give);
- pingpong: the halves pipelined, the GEMMs on one stream (qkv A, qkv B, o+mlp A,
  qkv A', o+mlp B, qkv B', ...) and the attention on another, each attention waiting
  for its half's qkv and each o+mlp for its half's attention;
- pingpong-hi: the same with the attention stream at high priority.

    python lab/probes/overlap_probe.py --rows 476 256 --context 384
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from decode_attention import graph_time_ms

from radixserve.engine.attention.triton_ops.decode import decode_attention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 4096, 32, 8, 128, 14336, 32
DISTINCT_LAYERS = 8  # weights cycled so that none stays in L2 (436 MB a layer)


class Half:
    """The buffers of one slice of the batch: input, q, attention output, KV indices."""

    def __init__(self, rows: int, context: int, slots: int, device: torch.device) -> None:
        self.rows = rows
        self.x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device=device) * 0.1
        self.qkv = torch.empty(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16,
                               device=device)  # fmt: skip
        self.attn_out = torch.empty(rows, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        self.q_rows = torch.arange(rows, dtype=torch.int64, device=device)
        self.kv_indptr = torch.arange(0, rows + 1, dtype=torch.int32, device=device) * context
        perm = torch.randperm(slots, generator=torch.Generator().manual_seed(rows))
        self.kv_indices = perm[: rows * context].to(torch.int32).to(device)
        self.mid_out = torch.empty(rows, HEADS, 1, HEAD_DIM, dtype=torch.float32, device=device)
        self.mid_lse = torch.empty(rows, HEADS, 1, dtype=torch.float32, device=device)


class Probe:
    def __init__(self, rows: int, context: int, device: torch.device) -> None:
        def w(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02

        self.weights = [
            (w(6144, HIDDEN), w(HIDDEN, HIDDEN), w(2 * INTER, HIDDEN), w(HIDDEN, INTER))
            for _ in range(DISTINCT_LAYERS)
        ]
        slots = rows * context + 1
        self.k = torch.randn(slots, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        self.v = torch.randn_like(self.k)
        self.whole = Half(rows, context, slots, device)
        self.halves = (Half(rows // 2, context, slots, device),
                       Half(rows - rows // 2, context, slots, device))  # fmt: skip

    def qkv(self, h: Half, layer: int) -> None:
        torch.matmul(h.x, self.weights[layer % DISTINCT_LAYERS][0].t(), out=h.qkv)

    def attn(self, h: Half) -> None:
        q = h.qkv[:, : HEADS * HEAD_DIM].view(h.rows, HEADS, HEAD_DIM)
        decode_attention(q, self.k, self.v, h.attn_out, h.q_rows, h.kv_indptr, h.kv_indices,
                         h.mid_out, h.mid_lse, HEAD_DIM**-0.5)  # fmt: skip

    def o_mlp(self, h: Half, layer: int) -> None:
        _, wo, wgu, wd = self.weights[layer % DISTINCT_LAYERS]
        o = F.linear(h.attn_out.view(h.rows, HIDDEN), wo)
        gu = F.linear(o, wgu)
        torch.matmul(gu[:, :INTER], wd.t(), out=h.x)

    # The modes: each issues one decode step's work on the current stream (and others).

    def gemm(self) -> None:
        for layer in range(LAYERS):
            self.qkv(self.whole, layer)
            self.o_mlp(self.whole, layer)

    def attn_only(self) -> None:
        for _ in range(LAYERS):
            self.attn(self.whole)

    def seq(self) -> None:
        for layer in range(LAYERS):
            self.qkv(self.whole, layer)
            self.attn(self.whole)
            self.o_mlp(self.whole, layer)

    def halves_seq(self) -> None:
        for h in self.halves:
            for layer in range(LAYERS):
                self.qkv(h, layer)
                self.attn(h)
                self.o_mlp(h, layer)

    def free(self, side: torch.cuda.Stream) -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.attn_only()
        self.gemm()
        main.wait_stream(side)

    def pingpong(self, side: torch.cuda.Stream) -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        a, b = self.halves
        qkv_done = {id(a): torch.cuda.Event(), id(b): torch.cuda.Event()}
        attn_done = {id(a): torch.cuda.Event(), id(b): torch.cuda.Event()}

        def launch_attn(h: Half) -> None:
            qkv_done[id(h)].record(main)
            side.wait_event(qkv_done[id(h)])
            with torch.cuda.stream(side):
                self.attn(h)
            attn_done[id(h)].record(side)

        self.qkv(a, 0)
        launch_attn(a)
        self.qkv(b, 0)
        launch_attn(b)
        for layer in range(LAYERS):
            for h in (a, b):
                main.wait_event(attn_done[id(h)])
                self.o_mlp(h, layer)
                if layer + 1 < LAYERS:
                    self.qkv(h, layer + 1)
                    launch_attn(h)
        main.wait_stream(side)


def run_config(rows: int, context: int, reps: int, device: torch.device) -> None:
    probe = Probe(rows, context, device)
    side = torch.cuda.Stream(priority=0)
    side_hi = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    modes: dict[str, Callable[[], None]] = {
        "gemm": probe.gemm,
        "attn": probe.attn_only,
        "seq": probe.seq,
        "halves": probe.halves_seq,
        "free": functools.partial(probe.free, side),
        "free-hi": functools.partial(probe.free, side_hi),
        "pingpong": functools.partial(probe.pingpong, side),
        "pingpong-hi": functools.partial(probe.pingpong, side_hi),
    }
    got: dict[str, list[float]] = {}
    for _round in range(2):  # alternating, twice, so that drift shows
        for name, fn in modes.items():
            got.setdefault(name, []).append(graph_time_ms(fn, reps, calls=1))
    seq = statistics.median(got["seq"])
    print(f"\nrows {rows}, context {context} (32 layers, ms; round 1 / round 2)")
    for name, ms in got.items():
        print(f"  {name:12s} {ms[0]:8.3f} / {ms[1]:8.3f}   x seq {ms[0] / seq:5.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[476, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[384])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), torch.__version__)
    for rows in args.rows:
        for context in args.context:
            run_config(rows, context, args.reps, device)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
