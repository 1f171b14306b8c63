"""HiCache in the engine: a device pool far smaller than the working set, prefixes served
back from host memory, and the same greedy tokens as a plain radix cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine
from tests.unit.engine_helpers import greedy_params, make_prompts

PREFIXES, PREFIX_LEN, TAILS, TAIL_LEN, NEW = 8, 96, 3, 12, 4


def _engine(model_dir: Path, **kwargs: object) -> Engine:
    return Engine(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        debug_check_invariants=True,
        **kwargs,
    )


def _workload(vocab_size: int) -> list[list[int]]:
    """Rounds over every prefix with a new tail each: 8 x (96 + 3 x 12) tokens in all."""
    parts = make_prompts(
        vocab_size, [PREFIX_LEN] * PREFIXES + [TAIL_LEN] * PREFIXES * TAILS, seed=3
    )
    prefixes, tails = parts[:PREFIXES], parts[PREFIXES:]
    return [prefixes[p] + tails[r * PREFIXES + p] for r in range(TAILS) for p in range(PREFIXES)]


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_prefixes_come_back_from_host_with_the_same_tokens(
    tiny_llama_dir: Path, policy: str
) -> None:
    plain = _engine(tiny_llama_dir)
    # 160 device slots: an eighth of the working set (1,344 tokens with the answers).
    hi = _engine(
        tiny_llama_dir, max_total_tokens=160, hicache_size_gb=0.01, hicache_write_policy=policy
    )
    prompts = _workload(plain.runner.vocab_size)
    served = []
    for prompt in prompts:
        want = plain.generate(input_ids=prompt, sampling_params=greedy_params(NEW))
        got = hi.generate(input_ids=prompt, sampling_params=greedy_params(NEW))
        assert isinstance(want, dict) and isinstance(got, dict)
        assert got["output_ids"] == want["output_ids"]
        served.append(got["meta_info"]["cached_tokens"])
    # After the first round every prefix is cached, on the host by the time it comes back.
    later = served[PREFIXES:]
    assert all(c >= PREFIX_LEN - 1 for c in later), served
    stats = hi.host_cache_stats()
    assert stats is not None and stats.loaded_tokens >= len(later) * (PREFIX_LEN - 1)
    assert plain.host_cache_stats() is None
    hi.scheduler.check_invariants()


def test_a_second_engine_answers_from_the_prefix_the_first_stored(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Two workers over one storage directory: the second has never seen the prefix."""
    shared = {"hicache_size_gb": 0.01, "hicache_storage_dir": str(tmp_path)}
    first = _engine(tiny_llama_dir, hicache_write_policy="write_through", **shared)
    second = _engine(tiny_llama_dir, **shared)
    plain = _engine(tiny_llama_dir)
    prefix, tail_a, tail_b = make_prompts(plain.runner.vocab_size, [100, 10, 12], seed=5)
    first.generate(input_ids=prefix + tail_a, sampling_params=greedy_params(NEW))
    got = second.generate(input_ids=prefix + tail_b, sampling_params=greedy_params(NEW))
    want = plain.generate(input_ids=prefix + tail_b, sampling_params=greedy_params(NEW))
    assert isinstance(got, dict) and isinstance(want, dict)
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["cached_tokens"] == 96  # the prefix's whole 16-token blocks
    stats = second.host_cache_stats()
    assert stats is not None and stats.store_loaded_tokens == 96 and stats.loaded_tokens == 0
    second.scheduler.check_invariants()


def test_hicache_config_errors(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs the radix cache"):
        _engine(tiny_llama_dir, hicache_size_gb=1.0, disable_radix_cache=True)
    with pytest.raises(ValueError, match="hicache_write_policy"):
        _engine(tiny_llama_dir, hicache_size_gb=1.0, hicache_write_policy="never")
    with pytest.raises(ValueError, match="needs the host tier"):
        _engine(tiny_llama_dir, hicache_storage_dir="/tmp/x")
    with pytest.raises(ValueError, match="hicache_size_gb must be"):
        _engine(tiny_llama_dir, hicache_size_gb=-1.0)
