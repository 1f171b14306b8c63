"""A shared-prefix prefill step's attention: one paged pass against two levels.

The cached shared-prefix run's question steps prefill a group's 16 questions (128
tokens each) over their 2048-token shared prefix, beside the decoders. Today one
FlashInfer paged prefill runs them as 16 requests of 2176 KV slots each (page size 1,
causal), so every 128-row query tile gathers the prefix's 2048 slots again. Two levels
(FlashInfer's cascade layout) split it: level 0 runs the group's 2048 query rows as ONE
request over the prefix (non-causal: every question sees all of it), level 1 each
question over its own 128 slots (causal), and `merge_state_in_place` folds level 0's
partial output into level 1's by their log-sum-exps. This script times both on one
layer's shapes (Llama-3.1-8B: 32 query heads, 8 KV heads, head dim 128, bf16) and
checks they agree, to decide whether the engine should run question steps that way.

    python bench/cascade_prefill.py [--groups 1 --questions 16 --question 128 --prefix 2048]
        [--backends fa2 fa3] [--reps 50]

Per backend: the median of CUDA-event timings of one layer's attention (planning
excluded: it is once per step), both ways, their max difference, and what the
difference would be over a step (x 32 layers) and over the run's 64 question steps.
Needs CUDA and flashinfer-python; `fa3` JIT-compiles FlashInfer's SM90 prefill on
first use (~90 s with MAX_JOBS=16).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from sampling import time_ms  # the CUDA-event median the sampling bench uses

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
LAYERS = 32
QUESTION_STEPS = 64  # the generated-shared-prefix run's (64 groups)


def _indptr(lens: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def build(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """A pool of one-slot pages holding `groups` prefixes and every question's own
    slots, scattered (as a radix cache's free list leaves them), and the queries."""
    g = torch.Generator(device="cpu").manual_seed(0)
    per_group = args.prefix + args.questions * args.question
    slots = args.groups * per_group
    perm = torch.randperm(slots, generator=g).to(torch.int32)
    k = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, torch.bfloat16)
    v = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, torch.bfloat16)
    rows = args.groups * args.questions * args.question
    q = torch.randn(rows, NUM_HEADS, HEAD_DIM, generator=g).to(device, torch.bfloat16)
    prefixes, owns = [], []
    for group in range(args.groups):
        base = group * per_group
        prefixes.append(perm[base : base + args.prefix])
        for i in range(args.questions):
            lo = base + args.prefix + i * args.question
            owns.append(perm[lo : lo + args.question])
    return {"q": q, "k": k, "v": v, "prefixes": prefixes, "owns": owns}  # type: ignore[dict-item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--question", type=int, default=128)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--backends", nargs="+", default=["fa2"], choices=["fa2", "fa3"])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import flashinfer

    device = torch.device("cuda")
    data = build(args, device)
    q, k, v = data["q"], data["k"], data["v"]
    prefixes: list[torch.Tensor] = data["prefixes"]  # type: ignore[assignment]
    owns: list[torch.Tensor] = data["owns"]  # type: ignore[assignment]
    paged = (k.unsqueeze(1), v.unsqueeze(1))  # [slots, page 1, heads, dim]
    n_req = args.groups * args.questions
    scale = 1.0 / math.sqrt(HEAD_DIM)
    shape = dict(
        num_qo_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim_qk=HEAD_DIM,
        page_size=1,
        sm_scale=scale,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    workspace = torch.zeros(384 * 2**20, dtype=torch.uint8, device=device)
    whole = [torch.cat([prefixes[r // args.questions], owns[r]]).to(device) for r in range(n_req)]
    q_lens = [args.question] * n_req
    rows_per_group = args.questions * args.question
    rows = []
    for backend in args.backends:
        # One paged pass: every question over prefix + its own slots, causal.
        one = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        one.plan(
            _indptr(q_lens, device),
            _indptr([len(s) for s in whole], device),
            torch.cat(whole),
            torch.ones(n_req, dtype=torch.int32, device=device),
            causal=True,
            **shape,
        )
        # Two levels: each group's rows over its prefix, then each question over its own.
        top = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        top.plan(
            _indptr([rows_per_group] * args.groups, device),
            _indptr([args.prefix] * args.groups, device),
            torch.cat(prefixes).to(device),
            torch.ones(args.groups, dtype=torch.int32, device=device),
            causal=False,
            **shape,
        )
        own = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        own.plan(
            _indptr(q_lens, device),
            _indptr([args.question] * n_req, device),
            torch.cat(owns).to(device),
            torch.ones(n_req, dtype=torch.int32, device=device),
            causal=True,
            **shape,
        )

        def one_pass(wrapper: object = one) -> torch.Tensor:
            return wrapper.run(q, paged)  # type: ignore[attr-defined]

        def two_levels(top: object = top, own: object = own) -> torch.Tensor:
            out, lse = own.run(q, paged, return_lse=True)  # type: ignore[attr-defined]
            out_top, lse_top = top.run(q, paged, return_lse=True)  # type: ignore[attr-defined]
            flashinfer.merge_state_in_place(out, lse, out_top, lse_top)
            return out

        diff = (one_pass().float() - two_levels().float()).abs().max().item()
        one_ms = time_ms(one_pass, args.reps)
        two_ms = time_ms(two_levels, args.reps)
        saved_ms = (one_ms - two_ms) * LAYERS
        rows.append(
            {
                "backend": backend,
                "one_pass_ms": round(one_ms, 4),
                "two_levels_ms": round(two_ms, 4),
                "max_abs_diff": diff,
                "step_saving_ms": round(saved_ms, 3),
                "run_saving_s": round(saved_ms * QUESTION_STEPS / 1000 / args.groups, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(f"device: {torch.cuda.get_device_name()}, flashinfer {flashinfer.__version__}")


if __name__ == "__main__":
    main()
