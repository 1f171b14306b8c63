"""`radixserve bench serving --dataset-path`: the ShareGPT and JSONL readers against the
real SmolLM2 tokenizer's own counts, on files written by tests/helpers/sharegpt_files.py.
The whole command runs against a live stack in tests/integration/test_bench_datasets.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from radixserve.benchmark.dataset_files import (
    file_kind,
    prompt_file_requests,
    sharegpt_file_requests,
)
from radixserve.benchmark.serving import build_requests, dataset_name
from radixserve.cli import build_parser
from radixserve.model_files.tokenizer import load_tokenizer
from tests.helpers.sharegpt_files import (
    ODD_CASES,
    sharegpt_records,
    write_prompt_file,
    write_sharegpt_file,
)

REGULAR = 24


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.fixture()
def sharegpt(tmp_path: Path) -> Path:
    return write_sharegpt_file(tmp_path / "sharegpt.json", n=REGULAR, seed=3)


def answers_by_prompt() -> dict[str, str]:
    """What the reader must yield, by hand: each regular conversation's turns 0 and 1, and
    the gpt-first one's turns 1 and 2; the one-turn, unanswered and one-word-answer
    conversations yield nothing."""
    records = sharegpt_records(REGULAR, seed=3)
    pairs = {
        r["conversations"][0]["value"]: r["conversations"][1]["value"] for r in records[:REGULAR]
    }
    gpt_first = dict(ODD_CASES)["gpt-first"]
    pairs[gpt_first[1]["value"]] = gpt_first[2]["value"]
    return pairs


def test_sharegpt_pairs_the_first_human_turn_with_its_answers_token_count(
    sharegpt: Path, tokenizer: Any
) -> None:
    requests = sharegpt_file_requests(sharegpt, tokenizer, random.Random(1), num_prompts=1000)
    expected = answers_by_prompt()
    assert sorted(str(r.prompt) for r in requests) == sorted(expected)
    for r in requests:
        answer = expected[str(r.prompt)]
        assert r.output_len == len(tokenizer.encode(answer, add_special_tokens=False))
        assert r.prompt_len == len(tokenizer.encode(r.prompt)) >= 2


def test_sharegpt_sampling_is_seeded_and_takes_the_first_kept_after_the_shuffle(
    sharegpt: Path, tokenizer: Any
) -> None:
    def prompts(seed: int, n: int) -> list[str]:
        return [
            str(r.prompt)
            for r in sharegpt_file_requests(sharegpt, tokenizer, random.Random(seed), n)
        ]

    everything = prompts(5, 1000)
    assert prompts(5, 1000) == everything and prompts(6, 1000) != everything
    assert prompts(5, 7) == everything[:7]


def test_sharegpt_output_len_overrides_and_context_len_drops_longer_pairs(
    sharegpt: Path, tokenizer: Any
) -> None:
    fixed = sharegpt_file_requests(sharegpt, tokenizer, random.Random(1), 1000, output_len=7)
    assert {r.output_len for r in fixed} == {7}
    # With the answer fixed at 7 tokens the one-word answer no longer drops its pair.
    assert "say ok" in {r.prompt for r in fixed}
    with pytest.raises(ValueError, match="sharegpt-output-len must be >= 4"):
        sharegpt_file_requests(sharegpt, tokenizer, random.Random(1), 10, output_len=3)

    context = 60
    kept = sharegpt_file_requests(sharegpt, tokenizer, random.Random(1), 1000, context_len=context)
    assert all(r.prompt_len + r.output_len <= context for r in kept)
    fitting = {
        prompt
        for prompt, answer in answers_by_prompt().items()
        if len(tokenizer.encode(prompt)) + len(tokenizer.encode(answer, add_special_tokens=False))
        <= context
    }
    assert {r.prompt for r in kept} == fitting and 0 < len(fitting) < len(answers_by_prompt())


def test_sharegpt_rejects_what_is_not_sharegpt(tmp_path: Path, tokenizer: Any) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="not ShareGPT-format"):
        sharegpt_file_requests(bad, tokenizer, random.Random(1), 10)
    bad.write_text("[{")
    with pytest.raises(ValueError, match="not JSON"):
        sharegpt_file_requests(bad, tokenizer, random.Random(1), 10)
    bad.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "hi"}]}]))
    with pytest.raises(ValueError, match="no prompt passed"):
        sharegpt_file_requests(bad, tokenizer, random.Random(1), 10)


def test_prompt_file_keeps_file_order_and_needs_an_output_len(
    tmp_path: Path, tokenizer: Any
) -> None:
    path = write_prompt_file(tmp_path / "prompts.jsonl", n=8, seed=2)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    head = prompt_file_requests(path, tokenizer, num_prompts=7)
    assert [r.prompt for r in head] == [line["prompt"] for line in lines[:7]]
    assert [r.output_len for r in head] == [line["output_len"] for line in lines[:7]]
    assert [r.prompt_len for r in head] == [
        len(tokenizer.encode(line["prompt"])) for line in lines[:7]
    ]
    with pytest.raises(ValueError, match=r"prompts.jsonl:8: no integer output_len"):
        prompt_file_requests(path, tokenizer, num_prompts=8)
    every = prompt_file_requests(path, tokenizer, num_prompts=8, output_len=5)
    assert len(every) == 8 and {r.output_len for r in every} == {5}
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: expected"):
        prompt_file_requests(path, tokenizer, num_prompts=1, output_len=5)


def parse(*argv: str) -> Any:
    return build_parser().parse_args(["bench", "serving", *argv])


def test_cli_reads_the_file_by_its_kind_and_needs_a_tokenizer(
    sharegpt: Path, tmp_path: Path, smollm2_dir: Path
) -> None:
    prompts = write_prompt_file(tmp_path / "prompts.jsonl", n=4)
    assert (file_kind(sharegpt), file_kind(prompts)) == ("sharegpt", "custom")
    assert dataset_name(parse()) == "random"
    assert dataset_name(parse("--dataset-path", str(prompts))) == "custom"
    assert (
        dataset_name(parse("--dataset-name", "sharegpt", "--dataset-path", str(prompts)))
        == "sharegpt"
    )
    with pytest.raises(ValueError, match="not --dataset-name random"):
        dataset_name(parse("--dataset-name", "random", "--dataset-path", str(sharegpt)))
    with pytest.raises(ValueError, match="custom reads --dataset-path"):
        dataset_name(parse("--dataset-name", "custom"))

    with pytest.raises(ValueError, match="--dataset-path needs --tokenizer DIR"):
        build_requests(parse("--dataset-path", str(sharegpt)), random.Random(1))
    ns = parse(
        "--dataset-path", str(sharegpt), "--tokenizer", str(smollm2_dir), "--num-prompts", "5"
    )
    requests = build_requests(ns, random.Random(ns.seed))
    assert len(requests) == 5 and all(r.prompt in answers_by_prompt() for r in requests)
    ns = parse(
        "--dataset-path",
        str(prompts),
        "--tokenizer",
        str(smollm2_dir),
        "--sharegpt-output-len",
        "6",
    )
    assert [r.output_len for r in build_requests(ns, random.Random(1))] == [6] * 4
