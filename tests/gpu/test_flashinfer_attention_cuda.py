"""The flashinfer attention backend on CUDA: decode and extend against the torch backend
on random bfloat16 inputs (Llama-3-8B's 32/8 heads and 8/8, page sizes 1 and 16,
cached prefixes, mixed batches), and the engine's greedy tokens with decode CUDA
graphs against Hugging Face's.

FlashInfer compiles its kernels on first use (nvcc): the first test of each kernel
family takes a while on a machine without a warm JIT cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer is not installed")

from radixserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend
from radixserve.engine.attention.hybrid import HybridAttentionBackend
from radixserve.engine.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.forward_batch import ForwardMode
from tests.helpers import attention_passes
from tests.helpers.attention_passes import Pass
from tests.helpers.tiny_models import make_tiny_llama

pytestmark = pytest.mark.gpu

HEAD_DIM = 128
LAYER = 1
# Worst |flashinfer - torch| over max |torch| in bfloat16: the triton suite's bound
# (both round the probabilities to bfloat16 at different points than SDPA).
TOLERANCE = 1e-2
HEADS = [(32, 8), (8, 8)]  # GQA on tensor cores (4 per KV head); plain decode kernel


def make_pass(
    prefix_lens: list[int],
    extend_lens: list[int],
    heads: tuple[int, int],
    mode: ForwardMode = ForwardMode.EXTEND,
    page_size: int = 1,
    seed: int = 0,
) -> Pass:
    return attention_passes.make_pass(
        prefix_lens,
        extend_lens,
        device=torch.device("cuda"),
        heads=heads[0],
        kv_heads=heads[1],
        head_dim=HEAD_DIM,
        page_size=page_size,
        dtype=torch.bfloat16,
        mode=mode,
        seed=seed,
    )


def error_against_torch(p: Pass, layers: tuple[int, ...] = (LAYER,)) -> float:
    backend = FlashInferAttentionBackend(torch.device("cuda"), torch.bfloat16)
    return attention_passes.compare_with_torch(p, backend, layers)


@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_matches_torch(heads: tuple[int, int], page_size: int) -> None:
    prefix_lens = [4095, 1, 17, 1000, 2047, 300, 0, 3333]
    p = make_pass(prefix_lens, [1] * 8, heads, ForwardMode.DECODE, page_size, seed=1)
    assert error_against_torch(p) < TOLERANCE


@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
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
    prefix_lens: list[int], extend_lens: list[int], heads: tuple[int, int], page_size: int
) -> None:
    p = make_pass(prefix_lens, extend_lens, heads, ForwardMode.EXTEND, page_size, seed=2)
    assert error_against_torch(p) < TOLERANCE


def test_one_plan_serves_every_layer() -> None:
    p = make_pass([300, 0, 45], [1, 200, 7], (32, 8), seed=3)
    assert error_against_torch(p, layers=(0, 1)) < TOLERANCE


def test_large_batch_decode_matches_torch() -> None:
    gen = torch.Generator().manual_seed(3)
    prefix_lens = torch.randint(0, 2048, (128,), generator=gen).tolist()
    p = make_pass(prefix_lens, [1] * 128, (32, 8), ForwardMode.DECODE, seed=3)
    assert error_against_torch(p) < TOLERANCE


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_decode_matches_torch(page_size: int) -> None:
    # Cascade decode (Triton kernels behind the flashinfer backend): 3 groups over
    # 2048-, 992- and 64-token prefixes, members scattered in the batch, 2 loners.
    p = make_pass(
        [2100, 1030, 2050, 80, 500, 2300, 993, 70, 9],
        [1] * 9,
        (32, 8),
        ForwardMode.DECODE,
        page_size,
        seed=5,
    )
    groups = [(2048, [5, 0, 2]), (992, [1, 6]), (64, [3, 7])]
    attention_passes.share_prefixes(p, groups)
    assert error_against_torch(p, layers=(0, 1)) < TOLERANCE


def test_shared_prefix_decodes_beside_prefills_match_torch() -> None:
    # A mixed batch as the shared-prefix benchmark's second wave has them: 48 decoders
    # in 3 groups of 16 over 2048-token prefixes (cascade, on the side stream), then
    # three 128-token questions after a cached 2048-token prefix and one whole prompt
    # (the prefill wrapper, on the current stream), over two layers.
    gen = torch.Generator().manual_seed(6)
    decoding = (2048 + torch.randint(1, 300, (48,), generator=gen)).tolist()
    p = make_pass(decoding + [2048] * 3 + [0], [1] * 48 + [128] * 3 + [700], (32, 8), seed=6)
    groups = [(2048, list(range(g, 48, 3))) for g in range(3)]
    attention_passes.share_prefixes(p, groups)
    assert p.batch.cascade_rows == 48
    assert error_against_torch(p, layers=(0, 1)) < TOLERANCE


# -- the SM90 prefill kernels (Hopper) ---------------------------------------------------
def sm90_backend() -> FlashInferAttentionBackend:
    """A backend whose SM90 prefill kernels are built (the first build JIT-compiles them:
    minutes on a cold cache)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the SM90 prefill kernels run on Hopper GPUs only")
    backend = FlashInferAttentionBackend(torch.device("cuda"), torch.bfloat16, sm90_prefill=True)
    backend.start_kernel_builds(32, 8, HEAD_DIM, torch.bfloat16)
    assert backend.wait_kernel_builds(1200), "the SM90 prefill kernels did not build"
    return backend


@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([0, 0], [4096, 300]),  # prompts alone
        ([8192, 3000, 45], [2048, 1, 1]),  # a long prompt's chunk beside two decoders
        # A mixed batch as a loaded server has one: 20 decoders first (Triton's decode,
        # after the SM90 kernel), then a long prompt's chunk over 8192 cached tokens.
        ([*range(100, 6000, 295), 8192], [1] * 20 + [2048]),
    ],
    ids=["prefills", "long_chunk_beside_decoders", "leading_decoders"],
)
def test_sm90_prefill_matches_torch(prefix_lens: list[int], extend_lens: list[int]) -> None:
    backend = sm90_backend()
    p = make_pass(prefix_lens, extend_lens, (32, 8), seed=7)
    error = attention_passes.compare_with_torch(p, backend, layers=(0, 1))
    assert backend.prefill_kernels == "fa3"
    assert error < TOLERANCE


def test_sm90_prefill_beside_cascade_decoders_matches_torch() -> None:
    # 48 decoders in 3 groups over 2048-token prefixes (cascade, side stream) beside a
    # long prompt's 2048-token chunk over 8192 cached tokens (SM90, current stream).
    backend = sm90_backend()
    gen = torch.Generator().manual_seed(8)
    decoding = (2048 + torch.randint(1, 300, (48,), generator=gen)).tolist()
    p = make_pass([*decoding, 8192], [1] * 48 + [2048], (32, 8), seed=8)
    attention_passes.share_prefixes(p, [(2048, list(range(g, 48, 3))) for g in range(3)])
    error = attention_passes.compare_with_torch(p, backend, layers=(0, 1))
    assert backend.prefill_kernels == "fa3"
    assert error < TOLERANCE


def test_short_passes_stay_on_fa2_once_sm90_is_built() -> None:
    backend = sm90_backend()
    # A 300-token prompt beside decoders over ~9.5k keys: the decoders weigh more.
    p = make_pass([3000, 2500, 4000, 0, 45], [1, 1, 1, 300, 1], (32, 8), seed=9)
    assert attention_passes.compare_with_torch(p, backend) < TOLERANCE
    assert backend.prefill_kernels == "fa2"


def test_float32_is_refused() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        FlashInferAttentionBackend(torch.device("cuda"), torch.float32)


# -- the engine: greedy tokens with decode graphs -----------------------------------------
# bfloat16 weights and activations against Hugging Face in float32: the tiny models'
# top-2 logits sit whole units apart, so a bf16 implementation may swap them only where
# the reference's gap is below this (the float32 suites allow 1e-4).
BF16_TIE_TOLERANCE = 0.5


@pytest.fixture(scope="module", params=[1, 4], ids=["group1", "group4"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head dim 128 (FlashInfer's kernels are built per head dim),
    4 query heads over 4 or 1 KV heads (the plain and the tensor-core decode)."""
    kv_heads = 4 // request.param
    folder = tmp_path_factory.mktemp(f"tiny_llama_flashinfer_{kv_heads}")
    return Path(make_tiny_llama(folder, seed=0, head_dim=HEAD_DIM, num_key_value_heads=kv_heads))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunked_prefill_size": 16},
        {"page_size": 16, "chunked_prefill_size": 32},
        {"chunked_prefill_size": 16, "disable_overlap_schedule": True},
        # auto: FlashInfer's prefill, Triton's decode (attention/hybrid.py).
        {"chunked_prefill_size": 16, "attention_backend": "auto"},
        {"page_size": 16, "chunked_prefill_size": 32, "attention_backend": "auto"},
    ],
    ids=["chunked", "paged", "no-overlap", "auto-chunked", "auto-paged"],
)
def test_engine_with_graphs_matches_hf(tiny_dir: Path, kwargs: dict[str, object]) -> None:
    from radixserve import Engine
    from tests.unit.engine_helpers import (
        assert_matches_reference,
        engine_outputs,
        hf_greedy,
        make_prompts,
    )

    # 5 and 17 requests decode on the padded graphs of 8 and 24; chunks of 16 or 32
    # tokens put decode requests beside prefill chunks (mixed batches).
    lengths = [3 + (7 * i) % 61 for i in range(17)]
    options: dict[str, object] = {"attention_backend": "flashinfer", **kwargs}
    with Engine(
        model_path=str(tiny_dir),
        device="cuda",
        dtype="bfloat16",
        max_total_tokens=8192,
        cuda_graph_max_bs=32,
        debug_check_invariants=True,
        **options,
    ) as engine:
        attn = engine.runner.attn
        if options["attention_backend"] == "auto":
            assert isinstance(attn, HybridAttentionBackend)
            assert isinstance(attn.prefill, FlashInferAttentionBackend)
            assert isinstance(attn.decode, TritonAttentionBackend)
        else:
            assert isinstance(attn, FlashInferAttentionBackend)
        graphs = engine.runner.graphs
        assert graphs is not None
        prompts = make_prompts(engine.runner.vocab_size, lengths, seed=5)
        ours = engine_outputs(engine, prompts[:5], 24) + engine_outputs(engine, prompts, 24)
        assert graphs.num_replays >= 23
    refs = hf_greedy(tiny_dir, prompts[:5] + prompts, 24, device="cuda")
    for out, ref in zip(ours, refs, strict=True):
        assert_matches_reference(out, ref, tolerance=BF16_TIE_TOLERANCE)


def test_auto_prefills_with_flashinfer_for_half_precision(tiny_dir: Path) -> None:
    from radixserve import Engine

    with Engine(model_path=str(tiny_dir), device="cuda", dtype="bfloat16") as engine:
        assert engine.runner.attn.name == "flashinfer+triton"
    with Engine(model_path=str(tiny_dir), device="cuda", dtype="float32") as engine:
        assert engine.runner.attn.name == "triton"
