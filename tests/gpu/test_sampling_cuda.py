"""The sampler's Triton draw compiled on CUDA over the Llama-3 vocabulary (128256)
against the torch sampler's sort-based draw, the engine's `sample` on CUDA (which
takes the kernel) against the same sampler on the CPU (the torch path), and the greedy
rows' argmax (two Triton kernels) against torch's.

Without CUDA the module skips before it imports the kernels (see
test_triton_attention_cuda.py: defining them here would fix them as compiled).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.sampling import SamplingBatch, SamplingParams, SamplingRequest, sample
from radixserve.engine.sampling.sampler import argmax_rows
from tests.helpers import sampling_cases as cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET is set in this process"),
]

DEVICE = torch.device("cuda")
VOCAB = 128256


@pytest.mark.parametrize("seed", [0, 1])
def test_random_rows_draw_what_the_torch_sampler_draws(seed: int) -> None:
    differ = cases.assert_same_draws(*cases.random_case(64, VOCAB, seed, DEVICE))
    assert differ <= 2  # rounding decides a pick only rarely


@pytest.mark.parametrize(("top_k", "top_p"), [(50, 1.0), (0, 0.9), (40, 0.55), (2000, 0.95)])
def test_ties_at_the_borders_keep_what_the_torch_sampler_keeps(top_k: int, top_p: float) -> None:
    # bf16-like logits on a coarse grid: large groups of ties straddle the borders.
    g = torch.Generator().manual_seed(top_k)
    logits = (torch.randint(0, 40, (8, VOCAB), generator=g) * 0.25).to(DEVICE)
    cases.assert_tied_borders(logits, top_k, top_p)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.7},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "min_p": 0.02},
    ],
    ids=["temperature", "top-p", "all"],
)
def test_sample_on_cuda_draws_what_the_cpu_sampler_draws(fields: dict[str, float]) -> None:
    # A mixed batch: greedy rows, sampled rows, a repetition penalty on some.
    bs = 48
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(bs, VOCAB, generator=g) * 4).bfloat16()
    reqs = [
        SamplingRequest(
            params=SamplingParams(
                **({"temperature": 0.0} if i % 5 == 0 else fields),
                repetition_penalty=1.3 if i % 3 == 0 else 1.0,
            ),
            seed=1000 + i,
            origin_input_ids=[int(t) for t in torch.randint(0, VOCAB, (20,), generator=g)],
            output_ids=[7] * (i % 4),
        )
        for i in range(bs)
    ]
    on_cpu = sample(logits, SamplingBatch.build(reqs, VOCAB, "cpu")).next_token_ids
    on_gpu = sample(logits.cuda(), SamplingBatch.build(reqs, VOCAB, DEVICE)).next_token_ids
    assert (on_gpu.cpu() != on_cpu).sum() <= 1, (on_gpu.cpu(), on_cpu)


def test_a_logit_bias_on_cuda_draws_what_the_cpu_sampler_draws() -> None:
    # OpenAI's logit_bias on some rows (a ban of the argmax, a boost), greedy and sampled.
    bs = 16
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(bs, VOCAB, generator=g) * 4).bfloat16()
    reqs = []
    for i in range(bs):
        bias = None
        if i % 2 == 0:
            bias = {int(logits[i].float().argmax()): -100.0, 1000 + i: 6.0}
        sampled = {"temperature": 0.8, "top_p": 0.95} if i % 3 else {"temperature": 0.0}
        reqs.append(SamplingRequest(params=SamplingParams(**sampled, logit_bias=bias), seed=50 + i))
    on_cpu = sample(logits, SamplingBatch.build(reqs, VOCAB, "cpu")).next_token_ids
    on_gpu = sample(logits.cuda(), SamplingBatch.build(reqs, VOCAB, DEVICE)).next_token_ids
    assert (on_gpu.cpu() != on_cpu).sum() <= 1, (on_gpu.cpu(), on_cpu)
    banned = [int(logits[i].float().argmax()) for i in range(0, bs, 2)]
    assert all(int(on_gpu[i]) != banned[i // 2] for i in range(0, bs, 2))


def test_warm_up_compiles_the_one_kernel_every_filter_mix_then_uses() -> None:
    from radixserve.engine.kernels.triton_ops.sampling import _draw_kernel
    from radixserve.engine.sampling import sampler

    def compiled() -> int:
        return sum(len(caches[0]) for caches in _draw_kernel.device_caches.values())

    sampler.warm_up(VOCAB, torch.bfloat16, DEVICE)
    before = compiled()
    assert before >= 2  # bf16 and float32 logits
    mixes = [
        {"temperature": 0.7},
        {"temperature": 0.7, "top_k": 40},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 0.7, "min_p": 0.05},
        {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05},
    ]
    logits = torch.randn(len(mixes), VOCAB, device=DEVICE).bfloat16()
    reqs = [
        SamplingRequest(params=SamplingParams(**mix), seed=i, output_ids=[1, 2])  # type: ignore[arg-type]
        for i, mix in enumerate(mixes)
    ]
    batch = SamplingBatch.build(reqs, VOCAB, DEVICE)
    sample(logits, batch)
    sample(logits.float(), batch)
    assert compiled() == before


def test_warm_up_compiles_the_greedy_argmax_the_steps_then_use() -> None:
    """A greedy first request on a fresh machine built the argmax's two kernels inside
    itself (~0.8 s on an H200, bench/start_up.py) until the warm-up ran them."""
    from radixserve.engine.kernels.triton_ops import argmax
    from radixserve.engine.sampling import sampler

    def compiled() -> int:
        kernels = (argmax._block_argmax_kernel, argmax._row_argmax_kernel)
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    vocab = 32064  # no other test here uses it: its kernels are not built yet
    before = compiled()
    sampler.warm_up(vocab, torch.bfloat16, DEVICE)
    warmed = compiled()
    assert warmed >= before + 3  # pass 1 for bf16 and for float32 logits, pass 2 once
    greedy = SamplingBatch.build(
        [SamplingRequest(SamplingParams(temperature=0.0), seed=0)] * 3, vocab, DEVICE
    )
    logits = torch.randn(3, vocab, device=DEVICE).bfloat16()
    for rows in (logits, logits.float()):
        assert torch.equal(sample(rows, greedy).next_token_ids, rows.argmax(dim=-1))
    assert compiled() == warmed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [VOCAB, 49152, 151936, 1000])
def test_greedy_argmax_on_cuda_is_torchs_first_index_on_ties(
    dtype: torch.dtype, vocab: int
) -> None:
    for name, logits in cases.argmax_cases(vocab, DEVICE, dtype).items():
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1)), name


@pytest.mark.parametrize("rows", [64, 512])
def test_greedy_argmax_of_a_large_batch_is_torchs(rows: int) -> None:
    """A decode step's worth of rows (the kernel's grid grows with them), with ties."""
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    logits = torch.randint(0, 50, (rows, VOCAB), generator=g, device=DEVICE).bfloat16()
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
