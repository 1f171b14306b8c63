"""Benchmark workloads, synthetic and seeded (nothing is downloaded); the user's own files
(ShareGPT JSON, a JSONL of prompts) are read by dataset_files.py.

    requests = generated_shared_prefix(rng, num_groups=4, prompts_per_group=8,
                                       system_prompt_len=512, question_len=32, output_len=16)

A prompt is a list of token ids drawn from `[vocab_low, vocab_high)`, so its length is
exact without a tokenizer; `radixserve bench serving --tokenizer PATH` decodes them to
text for servers that take text only. Shapes as SGLang's bench_serving:

- `random`: input and output lengths uniform in `[len * range_ratio, len]`.
- `sharegpt`: lengths drawn from log-normal fits of ShareGPT conversations (median
  prompt ~ 100 tokens with a long tail, median answer ~ 150), clipped to a context.
- `generated-shared-prefix`: groups of prompts that share a long system prompt and
  differ in a short question, sent group by group: what a radix cache is for.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DEFAULT_VOCAB_LOW = 1000  # past every common tokenizer's special tokens
DEFAULT_VOCAB_HIGH = 30000  # below every common vocabulary's size (Llama's 32000)


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids (the synthetic sets) or text (dataset_files.py)
    output_len: int
    group: int | None = None  # generated-shared-prefix: the shared prefix's group
    text_tokens: int = 0  # a text prompt's length by the tokenizer

    @property
    def prompt_len(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) else self.text_tokens


@dataclass(frozen=True)
class TokenRange:
    low: int = DEFAULT_VOCAB_LOW
    high: int = DEFAULT_VOCAB_HIGH

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"token id range [{self.low}, {self.high}) is empty")

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.low, self.high) for _ in range(n)]


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def random_requests(
    rng: random.Random,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    tokens: TokenRange = TokenRange(),
) -> list[BenchRequest]:
    check_positive(num_prompts=num_prompts, random_input_len=input_len)
    check_positive(random_output_len=output_len)
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")

    def length(full: int) -> int:
        return rng.randint(max(int(full * range_ratio), 1), full)

    return [
        BenchRequest(tokens.sample(rng, length(input_len)), length(output_len))
        for _ in range(num_prompts)
    ]


# Log-normal fits (of token counts) to ShareGPT's first human turn and first answer.
_SHAREGPT_PROMPT = (math.log(100.0), 1.2)
_SHAREGPT_OUTPUT = (math.log(150.0), 0.9)


def sharegpt_like_requests(
    rng: random.Random,
    num_prompts: int,
    context_len: int = 2048,
    output_len: int | None = None,
    tokens: TokenRange = TokenRange(),
) -> list[BenchRequest]:
    """ShareGPT-shaped lengths; `output_len` fixes every output length (as SGLang's
    `--sharegpt-output-len`). Prompt + output fit in `context_len`, prompts >= 4 tokens."""
    check_positive(num_prompts=num_prompts)
    if context_len < 8:
        raise ValueError(f"--sharegpt-context-len must be >= 8, got {context_len}")
    requests = []
    for _ in range(num_prompts):
        out = output_len or max(int(rng.lognormvariate(*_SHAREGPT_OUTPUT)), 1)
        out = min(out, context_len // 2)
        prompt = max(int(rng.lognormvariate(*_SHAREGPT_PROMPT)), 4)
        prompt = min(prompt, context_len - out)
        requests.append(BenchRequest(tokens.sample(rng, prompt), out))
    return requests


def generated_shared_prefix(
    rng: random.Random,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    tokens: TokenRange = TokenRange(),
) -> list[BenchRequest]:
    """Group by group: each group's prompts are its system prompt + their own question."""
    check_positive(
        gsp_num_groups=num_groups,
        gsp_prompts_per_group=prompts_per_group,
        gsp_system_prompt_len=system_prompt_len,
        gsp_question_len=question_len,
        gsp_output_len=output_len,
    )
    requests = []
    for group in range(num_groups):
        system = tokens.sample(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            requests.append(
                BenchRequest(system + tokens.sample(rng, question_len), output_len, group)
            )
    return requests


def expected_shared_prefix_hit_rate(
    num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int
) -> float:
    """The cache hit rate a perfect prefix cache reaches on `generated_shared_prefix`
    sent one at a time: every prompt but each group's first reuses the system prompt."""
    total = num_groups * prompts_per_group * (system_prompt_len + question_len)
    hits = num_groups * (prompts_per_group - 1) * system_prompt_len
    return hits / total
