"""The CPU sampler decides top-k and top-p among each row's most probable tokens first
(sampler._removed_on_cpu) and sorts whole only the rows it cannot decide there: its
removed sets must equal the full stable sort's exactly, row by row, in any batch."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.sampling import sampler
from tests.helpers import sampling_cases as cases

CPU = torch.device("cpu")
VOCAB = 3000


def both(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], tiers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    m = logits.shape[0]
    rows = cases.make_rows(CPU, VOCAB, [0.9] * m, top_k, top_p, [0.0] * m, [0.5] * m)
    probs = torch.softmax(logits / rows.temperatures, dim=-1)
    top_ks = rows.top_ks.clamp(max=VOCAB)
    fast = sampler._removed_on_cpu(probs, top_ks, rows.top_ps, tiers)
    full = sampler._removed_by_full_sort(probs, top_ks, rows.top_ps)
    return fast, full


# Small tiers so that rows fall through each of them to the full sort.
TIERS = [(16, 64), (256, 2048), (32,)]


@pytest.mark.parametrize("tiers", TIERS, ids=str)
@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0], ids=["flat", "normal", "peaked"])
def test_random_rows_remove_what_the_full_sort_removes(
    tiers: tuple[int, ...], scale: float
) -> None:
    g = torch.Generator().manual_seed(int(scale * 10))
    m = 24
    logits = torch.randn(m, VOCAB, generator=g) * scale
    top_k = [0, 5, 20, 50, 100, 300, 2500, 0] * 3
    top_p = [0.9, 1.0, 0.5, 0.95, 0.99, 0.8, 0.3, 1.0, 0.7, 0.999, 0.1, 0.6] * 2
    fast, full = both(logits, top_k, top_p, tiers)
    assert torch.equal(fast, full)


@pytest.mark.parametrize("tiers", TIERS, ids=str)
def test_tied_rows_remove_what_the_full_sort_removes(tiers: tuple[int, ...]) -> None:
    # A coarse grid: large groups of ties straddle the candidates' least value and the
    # top-k and top-p borders.
    g = torch.Generator().manual_seed(7)
    m = 16
    logits = torch.randint(0, 8, (m, VOCAB), generator=g).float()
    top_k = [0, 1, 10, 17, 40, 100, 0, 0] * 2
    top_p = [0.2, 0.9, 1.0, 0.5, 0.7, 1.0, 0.05, 0.99] * 2
    fast, full = both(logits, top_k, top_p, tiers)
    assert torch.equal(fast, full)


def test_a_row_decides_alike_alone_and_in_a_batch() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, VOCAB, generator=g) * 2
    top_k = [0, 30] * 6
    top_p = [0.9, 0.97, 0.4] * 4
    together, _ = both(logits, top_k, top_p, (16, 64))
    for r in range(12):
        alone, _ = both(logits[r : r + 1], top_k[r : r + 1], top_p[r : r + 1], (16, 64))
        assert torch.equal(alone[0], together[r])
