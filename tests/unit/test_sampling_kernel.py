"""The sampler's Triton draw (kernels/triton_ops/sampling.py) against the torch sampler's
sort-based draw, under the Triton interpreter on the CPU (tests/gpu runs it compiled on
the Llama-3 vocabulary). The cases and the bounds are in tests/helpers/sampling_cases.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine.kernels.triton_ops import sampling as kernel_module
from radixserve.engine.kernels.triton_ops.sampling import draw_triton
from tests.helpers import sampling_cases as cases
from tests.helpers.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device()
VOCAB = 333  # not a multiple of the kernel's block


@pytest.fixture(autouse=True, params=[64, 4096], ids=["6-blocks", "1-block"])
def block(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows over several blocks (per-block sums, ties across blocks) and in one."""
    monkeypatch.setattr(kernel_module, "BLOCK", request.param)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_rows_draw_what_the_torch_sampler_draws(seed: int) -> None:
    cases.assert_same_draws(*cases.random_case(12, VOCAB, seed, DEVICE))


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(0, 1.0, 0.0), (7, 1.0, 0.0), (0, 0.37, 0.0), (9, 0.61, 0.0), (0, 1.0, 0.3), (12, 0.8, 0.1)],
)
def test_each_filter_alone_and_together(top_k: int, top_p: float, min_p: float) -> None:
    g = torch.Generator().manual_seed(top_k + int(100 * top_p))
    m = 6
    logits = (torch.randn(m, VOCAB, generator=g) * 3).to(DEVICE)
    uniforms = torch.linspace(0.01, 0.99, m).tolist()
    rows = cases.make_rows(
        DEVICE, VOCAB, [0.8] * m, [top_k] * m, [top_p] * m, [min_p] * m, uniforms
    )
    cases.assert_same_draws(logits, rows)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.3), (40, 0.55), (0, 0.9)])
def test_ties_at_the_borders_keep_what_the_torch_sampler_keeps(top_k: int, top_p: float) -> None:
    # Logits on a coarse grid: the top-k and top-p borders fall inside groups of ties
    # (top-k keeps a whole group, top-p its first tokens by id).
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randint(0, 6, (4, VOCAB), generator=g).float().to(DEVICE)
    cases.assert_tied_borders(logits, top_k, top_p)


def test_a_row_draws_the_same_token_in_any_batch_and_reads_rows_in_place() -> None:
    logits, rows = cases.random_case(8, VOCAB, 5, DEVICE)
    whole = cases.kernel(logits, rows)
    pick = torch.tensor([6, 1, 3], device=DEVICE)
    subset = draw_triton(
        logits,
        pick,
        rows.temperatures[pick],
        rows.top_ks[pick],
        rows.top_ps[pick],
        rows.min_ps[pick],
        rows.uniforms[pick],
    )
    assert torch.equal(subset, whole[pick])


@pytest.mark.slow
def test_16_bit_logits_draw_as_their_float32_values() -> None:
    logits, rows = cases.random_case(6, VOCAB, 9, DEVICE)
    half = logits.to(torch.bfloat16)
    assert torch.equal(cases.kernel(half, rows), cases.kernel(half.float(), rows))


def test_masked_tokens_are_never_drawn() -> None:
    m = 5
    logits = torch.randn(m, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[:, ::2] = float("-inf")  # e.g. a grammar's mask
    rows = cases.make_rows(
        DEVICE,
        VOCAB,
        [1.5] * m,
        [0, 3, 0, 50, 0],
        [1.0, 1.0, 0.5, 0.9, 1.0],
        [0.0] * m,
        [0.999999] * m,
    )
    got = cases.kernel(logits.to(DEVICE), rows).cpu()
    assert bool((got % 2 == 1).all()), got
