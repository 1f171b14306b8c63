"""The greedy rows' Triton argmax (kernels/triton_ops/argmax.py) against torch's
`argmax(dim=-1)` under the Triton interpreter on the CPU (tests/gpu runs it compiled on
real vocabularies): the first index on ties, the first NaN, signed zeros alike, rows of
-inf, over one block and over several with a short last one.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine.kernels.triton_ops import argmax as kernel_module
from radixserve.engine.kernels.triton_ops.argmax import argmax_triton
from tests.helpers.sampling_cases import argmax_cases
from tests.helpers.triton_interpreter import kernel_test_device

DEVICE = kernel_test_device()


@pytest.fixture(autouse=True, params=[64, 2048], ids=["blocks", "one-block"])
def block(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_module, "BLOCK", request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 333, 1000])
def test_the_argmax_is_torchs(dtype: torch.dtype, vocab: int) -> None:
    for name, logits in argmax_cases(vocab, DEVICE, dtype).items():
        assert torch.equal(argmax_triton(logits), logits.argmax(dim=-1)), name


def test_rows_of_a_wider_buffer() -> None:
    """Rows with a stride (the runner's logits buffer) are read in place."""
    wide = torch.randn(4, 500, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits = wide[:, :333]
    assert torch.equal(argmax_triton(logits), logits.argmax(dim=-1))
    assert argmax_triton(wide[:0]).shape == (0,)
    assert argmax_triton(wide[:, :1]).tolist() == [0, 0, 0, 0]


def test_what_it_refuses() -> None:
    with pytest.raises(ValueError, match="2-D float"):
        argmax_triton(torch.zeros(3, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="2-D float"):
        argmax_triton(torch.zeros(4, 3, device=DEVICE).t())
    with pytest.raises(ValueError, match="1 to"):
        argmax_triton(torch.zeros(2, 0, device=DEVICE))
