"""The vocabulary-parallel head of a tied model on the CPU (gloo): each of two ranks
holds its rows of the embeddings as its head, and the gathered logits give what one rank
does (its own module: one tensor-parallel engine runs per process, and
test_tensor_parallel.py's are alive for its whole module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from tests.unit.engine_helpers import make_prompts

pytestmark = pytest.mark.timeout(300)

ENGINE = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}


def test_a_tied_head_split_over_two_ranks_scores_what_one_does(tiny_qwen3_dir: Path) -> None:
    """Qwen3's head is the embeddings: each rank's head is its rows of them (a view). The
    gathered logits give the same tokens and logprobs, the prompt's included."""
    one = Engine(str(tiny_qwen3_dir), **ENGINE)
    two = Engine(str(tiny_qwen3_dir), tp_size=2, **ENGINE)
    try:
        model = two.runner.model
        vocab = one.runner.vocab_size
        assert model.head_rows == vocab // 2
        head = model._head_weight()
        assert head.shape[0] == vocab // 2
        assert head.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # rank 0's rows
        prompts = make_prompts(vocab, [30, 9], seed=13)
        params = {
            "max_new_tokens": 6,
            "temperature": 0,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
        }
        expected = one.generate(input_ids=prompts, sampling_params=params)
        got = two.generate(input_ids=prompts, sampling_params=params)
    finally:
        two.shutdown()
        one.shutdown()
    assert isinstance(expected, list) and isinstance(got, list)
    for e, g in zip(expected, got, strict=True):
        assert g["output_ids"] == e["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            want, have = e["meta_info"][key], g["meta_info"][key]
            assert [t for _, t in have] == [t for _, t in want]
            assert [lp for lp, _ in have] == pytest.approx([lp for lp, _ in want], abs=1e-5)
        for key in ("input_top_logprobs", "output_top_logprobs"):
            want, have = e["meta_info"][key], g["meta_info"][key]
            assert _ids(have) == _ids(want) and len(have) == len(want)


def _ids(rows: list[Any]) -> list[list[int] | None]:
    """The token ids of each position's top logprobs (None where the first prompt token
    has none)."""
    return [None if row is None else [t for t, _ in row] for row in rows]
