"""The triton attention backend compiled on CUDA: Llama-8B-like shapes against the torch
backend, and the engine's greedy outputs against Hugging Face.

Without CUDA the module skips before it imports the kernels: defining them here would
fix them as compiled for the whole process, and the CPU tests need them interpreted.
If the CPU test module switched the interpreter on first, the kernels would run on
the host, so this module skips: run it in a pytest process of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from radixserve.engine.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.forward_batch import ForwardMode
from tests.helpers import attention_passes, decode_cases
from tests.helpers.attention_passes import Pass
from tests.helpers.tiny_models import make_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET is set in this process"),
]

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B's attention
LAYER = 1
# Worst |triton - torch| over max |torch|, per dtype, about twice the worst seen on an
# H100 (bf16 5.5e-3, fp16 4.9e-4, fp32 1.0e-6). The 16-bit backends round the
# probabilities at different points (triton before the PV product); float32 runs both
# products in full precision (no tf32).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_pass(
    prefix_lens: list[int],
    extend_lens: list[int],
    dtype: torch.dtype,
    mode: ForwardMode = ForwardMode.EXTEND,
    page_size: int = 1,
    seed: int = 0,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
) -> Pass:
    """Llama-3-8B attention shapes (or other head counts) over the shared noisy, shuffled
    pool."""
    return attention_passes.make_pass(
        prefix_lens,
        extend_lens,
        device=torch.device("cuda"),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        page_size=page_size,
        dtype=dtype,
        mode=mode,
        seed=seed,
    )


def compare_with_torch(p: Pass) -> float:
    return attention_passes.compare_with_torch(
        p, TritonAttentionBackend(torch.device("cuda")), (LAYER,)
    )


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_torch(dtype: torch.dtype, page_size: int) -> None:
    # Ragged lengths up to 4096: 16 splits, and short requests with empty splits.
    prefix_lens = [4095, 1, 17, 1000, 2047, 300, 0, 3333]
    p = make_pass(prefix_lens, [1] * 8, dtype, ForwardMode.DECODE, page_size, seed=1)
    assert compare_with_torch(p) < TOLERANCE[dtype]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([0, 0], [4096, 77]),  # prefills
        ([2048, 100, 0], [2048, 1000, 513]),  # chunk continuations over cached prefixes
        ([3000, 0, 45, 1], [1, 1500, 1, 300]),  # mixed: decodes beside prefills
    ],
    ids=["prefill", "cached_prefix", "mixed"],
)
def test_extend_matches_torch(
    prefix_lens: list[int], extend_lens: list[int], dtype: torch.dtype, page_size: int
) -> None:
    p = make_pass(prefix_lens, extend_lens, dtype, ForwardMode.EXTEND, page_size, seed=2)
    assert compare_with_torch(p) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads",
    [(8, 8), (12, 4), (28, 4), (64, 8), (32, 1)],
    ids=["mha", "group_of_3", "group_of_7", "group_of_8", "mqa"],
)
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [([2048, 0, 17], [16, 300, 5]), ([100, 0], [16, 8])],
    ids=["long", "short"],
)
def test_extend_packs_every_group_size(
    heads: int,
    kv_heads: int,
    prefix_lens: list[int],
    extend_lens: list[int],
    dtype: torch.dtype,
) -> None:
    """The extend kernel's programs take a block of tokens at every query head of a KV
    head: group sizes that are not powers of two leave padding rows, and on a GPU with
    room the pass's length picks 128-row blocks (long) or three stages (short)."""
    p = make_pass(
        prefix_lens, extend_lens, dtype, seed=heads + kv_heads, heads=heads, kv_heads=kv_heads
    )
    assert compare_with_torch(p) < TOLERANCE[dtype]


def test_large_batch_decode_matches_torch() -> None:
    gen = torch.Generator().manual_seed(3)
    prefix_lens = torch.randint(0, 2048, (128,), generator=gen).tolist()
    p = make_pass(prefix_lens, [1] * 128, torch.bfloat16, ForwardMode.DECODE, seed=3)
    assert compare_with_torch(p) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_kernel_paths_match_torch(num_splits: int) -> None:
    # bf16 at Llama-3-8B shapes: 48 requests as the decode rows of a mixed batch
    # (shuffled, with rows between them no request owns), lengths from 1 to 2048.
    # One split runs one pass (what graphs of 33+ requests run); its two-stage form
    # and 8 splits go through stage 2.
    gen = torch.Generator().manual_seed(5)
    seq_lens = [1, *torch.randint(1, 2049, (47,), generator=gen).tolist()]
    q_rows = (2 * torch.randperm(48, generator=gen)).tolist()
    case = decode_cases.make_case(
        seq_lens,
        q_rows,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
        seed=5,
    )
    out = decode_cases.run_kernel(case, num_splits)
    assert decode_cases.relative_error(case, out) < TOLERANCE[torch.bfloat16]
    if num_splits == 1:
        two_stage = decode_cases.run_kernel(case, 1, two_stage=True)
        assert decode_cases.relative_error(case, two_stage) < TOLERANCE[torch.bfloat16]


def shared_prefix_pass(dtype: torch.dtype, page_size: int, seed: int) -> Pass:
    """64 decoding requests in 4 groups of 16 over 2048-token shared prefixes, in a shuffled
    batch order, beside 8 requests outside any group (the shared-prefix benchmark's shape)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = 2048
    suffixes = torch.randint(1, 400, (72,), generator=gen).tolist()
    order = torch.randperm(72, generator=gen).tolist()
    kv_lens = [prefix + n if i < 64 else n for i, n in enumerate(suffixes)]
    p = make_pass([kv_lens[i] for i in order], [1] * 72, dtype, ForwardMode.DECODE, page_size, seed)
    where = {orig: pos for pos, orig in enumerate(order)}
    groups = [(prefix, [where[g * 16 + m] for m in range(16)]) for g in range(4)]
    attention_passes.share_prefixes(p, groups)
    return p


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shared_prefix_decode_matches_torch(dtype: torch.dtype, page_size: int) -> None:
    p = shared_prefix_pass(dtype, page_size, seed=4)
    assert compare_with_torch(p) < TOLERANCE[dtype]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_triton"), seed=0))


@pytest.mark.parametrize(
    "kwargs",
    [{"chunked_prefill_size": 16}, {"page_size": 16, "chunked_prefill_size": 32}],
    ids=["chunked", "paged"],
)
def test_engine_float32_matches_hf(tiny_dir: Path, kwargs: dict[str, object]) -> None:
    # The engine's imports (and the service dependencies they pull in) stay out of the
    # module, so the kernel tests above run on a machine with only torch and triton.
    from radixserve import Engine
    from tests.unit.engine_helpers import (
        assert_matches_reference,
        engine_outputs,
        hf_greedy,
        make_prompts,
    )

    engine = Engine(
        model_path=str(tiny_dir),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=8192,
        **kwargs,
    )
    try:
        prompts = make_prompts(engine.runner.vocab_size, [5, 17, 40, 3, 64])
        ours = engine_outputs(engine, prompts, 32)
    finally:
        engine.shutdown()
    for out, ref in zip(ours, hf_greedy(tiny_dir, prompts, 32, device="cuda"), strict=True):
        assert_matches_reference(out, ref)


def test_auto_picks_triton_on_cuda(tiny_dir: Path) -> None:
    from radixserve import Engine

    engine = Engine(model_path=str(tiny_dir), device="cuda", attention_backend="auto")
    try:
        assert isinstance(engine.runner.attn, TritonAttentionBackend)
    finally:
        engine.shutdown()
