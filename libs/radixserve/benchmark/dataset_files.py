"""Workloads from the user's files: ShareGPT-format JSON and a JSONL of prompts.

    tokenizer = load_tokenizer(DIR)
    requests = sharegpt_file_requests(path, tokenizer, rng, num_prompts=1000)
    requests = prompt_file_requests(path, tokenizer, num_prompts=100, output_len=None)

ShareGPT (the ShareGPT_V3 layout: a list of {"id", "conversations": [{"from", "value"}, ...]})
is sampled as SGLang's bench_serving `sample_sharegpt_requests` samples it: conversations
with fewer than 2 turns are skipped, the rest shuffled (seeded), then taken in turn until
`num_prompts` are kept; the prompt is the first human turn and the output length is the
token count of the gpt turn that answers it (`output_len` overrides it); pairs whose
prompt or output is under 2 tokens, or whose sum exceeds `context_len`, are dropped.
Where SGLang takes turns 0 and 1 as they come, a conversation here yields its first
human turn that a gpt turn follows (the same pair on ShareGPT_V3's human-first
conversations). The answer is counted without special tokens (SGLang's count has the
BOS in it); the prompt with them, as the server counts it.

A JSONL of prompts has one {"prompt": str, "output_len": int (optional)} a line, taken
in file order (the order may be the workload, e.g. shared prefixes group by group) with
the same length filters; `output_len` overrides every line's and is needed by lines
without one.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.benchmark.datasets import BenchRequest, check_positive

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MIN_TOKENS = 2  # SGLang's: shorter prompts and answers are dropped
MIN_OUTPUT_LEN = 4  # SGLang's least --sharegpt-output-len


def file_kind(path: str | Path) -> str:
    """The dataset name a file reads as: `custom` (vLLM's name) for .jsonl, else `sharegpt`."""
    return "custom" if Path(path).suffix == ".jsonl" else "sharegpt"


def sharegpt_file_requests(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    rng: random.Random,
    num_prompts: int,
    output_len: int | None = None,
    context_len: int | None = None,
) -> list[BenchRequest]:
    check_positive(num_prompts=num_prompts)
    _check_output_len(output_len)
    records = _read_json(Path(path))
    if not isinstance(records, list):
        raise ValueError(f"{path}: not ShareGPT-format JSON (a list of conversations)")
    exchanges = [pair for pair in map(_first_exchange, records) if pair is not None]
    rng.shuffle(exchanges)
    requests: list[BenchRequest] = []
    for prompt, answer in exchanges:
        if len(requests) == num_prompts:
            break
        out = output_len or len(tokenizer.encode(answer, add_special_tokens=False))
        request = _kept(tokenizer, prompt, out, context_len)
        if request is not None:
            requests.append(request)
    return _some(requests, path)


def prompt_file_requests(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int,
    output_len: int | None = None,
    context_len: int | None = None,
) -> list[BenchRequest]:
    check_positive(num_prompts=num_prompts)
    _check_output_len(output_len)
    requests: list[BenchRequest] = []
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if len(requests) == num_prompts:
                break
            if not line.strip():
                continue
            record = _json_line(line, path, number)
            out = output_len or record.get("output_len")
            if not isinstance(out, int) or isinstance(out, bool):
                raise ValueError(
                    f"{path}:{number}: no integer output_len; add one or pass --sharegpt-output-len"
                )
            request = _kept(tokenizer, record["prompt"], out, context_len)
            if request is not None:
                requests.append(request)
    return _some(requests, path)


def _check_output_len(output_len: int | None) -> None:
    if output_len is not None and output_len < MIN_OUTPUT_LEN:
        raise ValueError(f"--sharegpt-output-len must be >= {MIN_OUTPUT_LEN}, got {output_len}")


def _read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc


def _json_line(line: str, path: str | Path, number: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError(f'{path}:{number}: expected {{"prompt": str, "output_len": int}}')
    return record


def _first_exchange(record: Any) -> tuple[str, str] | None:
    """The first human turn that a gpt turn answers: (prompt, answer)."""
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations", record.get("conversation"))  # SGLang takes both
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    for asked, answered in itertools.pairwise(turns):
        if not (isinstance(asked, dict) and isinstance(answered, dict)):
            return None
        prompt, answer = asked.get("value"), answered.get("value")
        if (asked.get("from"), answered.get("from")) == ("human", "gpt"):
            if isinstance(prompt, str) and isinstance(answer, str):
                return prompt, answer
            return None
    return None


def _kept(
    tokenizer: PreTrainedTokenizerBase, prompt: str, output_len: int, context_len: int | None
) -> BenchRequest | None:
    prompt_len = len(tokenizer.encode(prompt))
    if prompt_len < MIN_TOKENS or output_len < MIN_TOKENS:
        return None
    if context_len is not None and prompt_len + output_len > context_len:
        return None
    return BenchRequest(prompt, output_len, text_tokens=prompt_len)


def _some(requests: list[BenchRequest], path: str | Path) -> list[BenchRequest]:
    if not requests:
        raise ValueError(f"{path}: no prompt passed the length filters")
    return requests
