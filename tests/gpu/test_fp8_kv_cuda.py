"""The FP8 KV cache on CUDA.

Kernels: the triton and flashinfer backends over FP8 pools (e4m3 codes, per-layer scales
that are not 1) against the torch reference on the same pools (which the CPU suite
checks against attention over the dequantized values), bfloat16 queries at
Llama-3-8B's heads (32/8, head dim 128): decode over long sequences, extend over cached
prefixes, mixed batches, cascade over shared prefixes.

Engine: a tiny random Llama (head dim 128) with kv_cache_dtype fp8_e4m3 on each backend,
with and without decode CUDA graphs: greedy tokens equal greedy decoding over an FP8
pool outside the engine (tests/helpers/fp8_kv.py, on the GPU, same dtype) but at
near-ties; a second round hits the radix cache and runs cascade over the shared
prompt prefix (in graphs too). FlashInfer runs bfloat16 queries only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from radixserve import Engine
from radixserve.engine.attention.base import AttentionBackend
from radixserve.engine.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.kernels.fp8_format import FP8_DTYPE
from radixserve.engine.kvcache.fp8 import KVScale
from tests.helpers import attention_passes
from tests.helpers.fp8_kv import fp8_kv_greedy
from tests.helpers.tiny_models import make_tiny_llama
from tests.unit.engine_helpers import assert_matches_reference, greedy_params, make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="the kernels run interpreted here"),
]

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
DEVICE = torch.device("cuda")
HEAD_DIM = 128
SCALES = (KVScale(0.37, 1.9), KVScale(2.5, 0.11))
# Worst |backend - torch| over max |torch|, bfloat16 queries over the same dequantized
# K/V (test_flashinfer_attention_cuda's bfloat16 bound: both sides round the scores
# and probabilities to bfloat16 in different places).
TOLERANCE = 1e-2
BF16_TIE_TOLERANCE = 0.5
FP32_TIE_TOLERANCE = 1e-4


def _backend(name: str) -> AttentionBackend:
    if name == "flashinfer":
        if not HAS_FLASHINFER:
            pytest.skip("flashinfer is not installed")
        from radixserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(DEVICE, torch.bfloat16)
    return TritonAttentionBackend(DEVICE)


def _error(
    name: str,
    prefix: list[int],
    extend: list[int],
    mode: ForwardMode,
    groups: list[tuple[int, list[int]]] | None = None,
) -> float:
    shape: dict[str, Any] = dict(device=DEVICE, heads=32, kv_heads=8, head_dim=HEAD_DIM, mode=mode)
    p = attention_passes.make_pass(
        prefix,
        extend,
        dtype=torch.bfloat16,
        kv_dtype=FP8_DTYPE,
        kv_scales=SCALES,
        seed=len(prefix),
        **shape,
    )
    if groups is not None:
        attention_passes.share_prefixes(p, groups)
    return attention_passes.compare_with_torch(p, _backend(name), (0, 1))


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_decode_matches_torch(name: str) -> None:
    prefix = [4095, 1, 17, 1000, 2047, 300, 0, 99]
    assert _error(name, prefix, [1] * 8, ForwardMode.DECODE) < TOLERANCE


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
@pytest.mark.parametrize(
    "prefix,extend",
    [([0, 0], [2000, 77]), ([1500, 90, 0], [700, 300, 513]), ([3000, 0, 45, 1], [1, 900, 1, 300])],
    ids=["prefill", "cached_prefix", "mixed"],
)
def test_extend_matches_torch(name: str, prefix: list[int], extend: list[int]) -> None:
    assert _error(name, prefix, extend, ForwardMode.EXTEND) < TOLERANCE


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_cascade_matches_torch(name: str) -> None:
    prefix = [1370, 8, 40, 1300, 20, 1331]
    groups = [(1300, [3, 0, 5]), (8, [4, 1])]
    assert _error(name, prefix, [1] * 6, ForwardMode.DECODE, groups) < TOLERANCE
    # Decoders sharing prefixes beside prefills (cascade beside the prefill kernel).
    mixed = _error(name, [1370, 1300, 0, 16], [1, 1, 700, 3], ForwardMode.EXTEND, [(1300, [1, 0])])
    assert mixed < TOLERANCE


# -- the engine ------------------------------------------------------------------------
MAX_NEW = 16
# backend -> engine dtype; FlashInfer runs half precision only.
BACKENDS = {"triton": "float32", "flashinfer": "bfloat16"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_fp8_kv"), seed=3, head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    common = make_prompts(1000, [80], seed=31)[0]
    tails = make_prompts(1000, [5, 40, 17, 3], seed=32)
    return [common + tail for tail in tails]


@pytest.mark.parametrize(
    ("backend", "graphs"),
    [(b, g) for b in BACKENDS for g in (True, False)],
    ids=[f"{b}-graphs_{g}" for b in BACKENDS for g in (True, False)],
)
def test_engine_greedy_tokens(
    model_dir: Path, prompts: list[list[int]], backend: str, graphs: bool
) -> None:
    if backend == "flashinfer" and not HAS_FLASHINFER:
        pytest.skip("flashinfer is not installed")
    dtype = BACKENDS[backend]
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    refs = fp8_kv_greedy(model_dir, prompts, MAX_NEW, device="cuda", dtype=torch_dtype)
    tolerance = BF16_TIE_TOLERANCE if dtype == "bfloat16" else FP32_TIE_TOLERANCE
    with Engine(
        model_path=str(model_dir),
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        kv_cache_dtype="fp8_e4m3",
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=8,
        chunked_prefill_size=32,
        max_total_tokens=8192,
        debug_check_invariants=True,
    ) as engine:
        assert engine.runner.kv_pool.k_buffers[0].dtype == FP8_DTYPE
        assert (engine.runner.graphs is not None) == graphs
        cached = 0
        for _ in range(2):  # the second round hits the radix cache: cascade decode
            outs = engine.generate(input_ids=prompts, sampling_params=greedy_params(MAX_NEW))
            assert isinstance(outs, list)
            for out, ref in zip(outs, refs, strict=True):
                assert_matches_reference(out["output_ids"], ref, tolerance=tolerance)
            cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
    assert cached >= 4 * 80
    assert replays > 0 if graphs else replays == 0


def test_pool_holds_twice_the_tokens(model_dir: Path) -> None:
    """The same memory fraction sizes an FP8 pool of twice the tokens (within the few
    tokens the free memory moves by between the two starts)."""
    sizes = {}
    for kv in ("auto", "fp8_e4m3"):
        with Engine(
            model_path=str(model_dir),
            device="cuda",
            dtype="bfloat16",
            kv_cache_dtype=kv,
            mem_fraction_static=0.3,
            disable_cuda_graph=True,
        ) as engine:
            sizes[kv] = engine.runner.kv_pool.size
    assert abs(sizes["fp8_e4m3"] / sizes["auto"] - 2.0) < 0.01
