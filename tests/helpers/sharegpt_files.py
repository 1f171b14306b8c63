"""Tiny dataset files for `radixserve bench serving --dataset-path`, written at test time.

    python -m tests.helpers.sharegpt_files OUT_DIR   # sharegpt.json and prompts.jsonl

`write_sharegpt_file` writes ShareGPT_V3's layout (a list of {"id", "conversations":
[{"from", "value"}, ...]}), seeded, with the cases the reader must skip or pair
differently: a one-turn conversation, one that opens with a gpt turn, one whose answer
is a single word, one with no gpt answer at all. English words, so that a real
tokenizer's counts look like text's. Nothing is downloaded; the real file is the user's.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

WORDS = (
    "the cache holds every prefix that a request shares with the ones before it so a "
    "second prompt skips most of its prefill while decode steps keep running beside it "
    "how would you explain attention to a student who knows matrices but not networks "
    "write a short poem about servers answering at night with tokens flowing like rain"
).split()

# (id, conversation): the odd cases, after the regular ones.
ODD_CASES: tuple[tuple[str, list[dict[str, str]]], ...] = (
    ("one-turn", [{"from": "human", "value": "is anyone there"}]),
    (
        "gpt-first",
        [
            {"from": "gpt", "value": "hello how can I help"},
            {"from": "human", "value": "explain the radix cache in two sentences please"},
            {"from": "gpt", "value": "it stores prefixes in a tree and reuses them later on"},
        ],
    ),
    (
        "short-answer",
        [{"from": "human", "value": "say ok"}, {"from": "gpt", "value": "ok"}],
    ),
    (
        "unanswered",
        [{"from": "human", "value": "first question"}, {"from": "human", "value": "again"}],
    ),
)


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def sharegpt_records(n: int = 24, seed: int = 0) -> list[dict[str, Any]]:
    """`n` regular conversations (2 to 6 turns, human first) and then the odd cases."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    for i in range(n):
        turns = []
        for t in range(rng.choice((2, 3, 4, 6))):
            speaker = "human" if t % 2 == 0 else "gpt"
            turns.append({"from": speaker, "value": _sentence(rng, 3, 60)})
        records.append({"id": f"conv-{i}", "conversations": turns})
    records += [{"id": cid, "conversations": turns} for cid, turns in ODD_CASES]
    return records


def write_sharegpt_file(path: Path, n: int = 24, seed: int = 0) -> Path:
    path.write_text(json.dumps(sharegpt_records(n, seed), indent=1))
    return path


def write_prompt_file(path: Path, n: int = 8, seed: int = 0) -> Path:
    """A JSONL of prompts: every line has output_len but the last."""
    rng = random.Random(seed)
    lines = [{"prompt": _sentence(rng, 4, 40), "output_len": rng.randint(4, 12)} for _ in range(n)]
    lines[-1].pop("output_len")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    print(write_sharegpt_file(out / "sharegpt.json"), write_prompt_file(out / "prompts.jsonl"))
