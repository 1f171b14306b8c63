"""The vocabulary-parallel embeddings and head on the CPU (gloo): each of two ranks holds
its rows of the embeddings (a tied head: the same storage as its head; an untied head: its
own rows of it), and the all-reduced embeddings and gathered logits give what one rank
does; where the ranks do not divide the vocabulary, both are whole on every rank (its own
module: one tensor-parallel engine runs per process, and test_tensor_parallel.py's are
alive for its whole module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from tests.helpers.tiny_models import make_tiny_qwen3
from tests.unit.engine_helpers import make_prompts

pytestmark = pytest.mark.timeout(300)

ENGINE = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def odd_vocab_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied Qwen3 whose vocabulary two ranks do not divide (one row short of the
    tokenizer's, so every id it can emit decodes)."""
    folder = tmp_path_factory.mktemp("tiny_qwen3_odd_vocab")
    return Path(make_tiny_qwen3(folder, seed=1, vocab_size=49151))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_fixture", "tied"),
    [
        pytest.param("tiny_qwen3_dir", True, id="tied"),
        pytest.param("tiny_llama_dir", False, id="untied"),
        pytest.param("odd_vocab_qwen3_dir", True, id="whole-table"),
    ],
)
def test_two_ranks_score_what_one_does(
    model_fixture: str, tied: bool, request: pytest.FixtureRequest
) -> None:
    """Each rank's embeddings are its rows of the table (Qwen3's head is those very rows,
    Llama's its own rows of the head), or the whole table where 2 does not divide the
    vocabulary. The same tokens and logprobs as one rank, the prompt's included."""
    model_dir: Path = request.getfixturevalue(model_fixture)
    one = Engine(str(model_dir), **ENGINE)
    two = Engine(str(model_dir), tp_size=2, **ENGINE)
    try:
        model = two.runner.model
        assert model.config.tie_word_embeddings == tied
        vocab = one.runner.vocab_size
        rows = vocab // 2 if vocab % 2 == 0 else vocab
        embeddings, head = model.model.embed_tokens.weight, model.lm_head.weight
        assert embeddings.shape[0] == head.shape[0] == rows
        assert model.head_rows == (None if rows == vocab else rows)
        # A tied head is the rank's embeddings themselves; an untied one its own tensor.
        assert (head.data_ptr() == embeddings.data_ptr()) == tied
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
