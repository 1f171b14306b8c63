"""The GEMM library's settings: the heuristics cache sized from the engine's eager steps."""

from __future__ import annotations

import pytest

from radixserve.engine import blas
from radixserve.engine.config import EngineConfig


@pytest.mark.parametrize(
    ("options", "rows"),
    [
        ({}, 2048 + 512),  # a 2048-token chunk beside 512 decoders
        ({"chunked_prefill_size": 8192, "max_prefill_tokens": 4096}, 4096 + 512),
        ({"chunked_prefill_size": 0, "max_prefill_tokens": 4096}, 4096 + 512),
    ],
)
def test_capacity_holds_every_eager_row_count(options: dict[str, int], rows: int) -> None:
    config = EngineConfig(**options)  # type: ignore[arg-type]
    assert blas.heuristics_cache_capacity(config, 512) == blas.PROBLEMS_PER_ROW_COUNT * rows


def test_capacity_is_bounded() -> None:
    config = EngineConfig(chunked_prefill_size=-1, max_prefill_tokens=1 << 20)
    assert blas.heuristics_cache_capacity(config, 512) == blas.MAX_CAPACITY


def test_process_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(blas.CAPACITY_ENV, "100")
    monkeypatch.setattr(blas, "cublaslt_library", lambda: pytest.fail("library asked"))
    assert blas.size_heuristics_cache(1 << 15) is None


def test_without_cublaslt_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU torch loads no libcublasLt: the cache is left alone, without an error."""
    monkeypatch.delenv(blas.CAPACITY_ENV, raising=False)
    if blas.cublaslt_library() is not None:
        pytest.skip("this process loaded libcublasLt (CUDA torch)")
    assert blas.size_heuristics_cache(1 << 15) is None
