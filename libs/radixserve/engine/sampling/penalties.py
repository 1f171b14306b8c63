"""Logit processors applied to every row before greedy or random choice.

- `Penalties`: repetition (HF-style, over prompt + output tokens), then frequency and
  presence (over output tokens only), in that order, as vLLM applies them.
- `LogitBias`: OpenAI's `logit_bias`, each row's values added to its tokens' logits.
- `StopTokenMask`: while a request has fewer than `min_new_tokens` outputs, its stop ids
  (eos unless `ignore_eos`, plus `stop_token_ids`) get -inf so that it cannot stop.

`Penalties.build` scatters the token lists into [bs, vocab] tensors (`mark_seen`,
`add_counts`); the engine keeps them on the device across steps instead
(`penalty_state.PenaltyState`, built with the same two scatters). Applying them is a few
elementwise ops over the penalized rows, never a loop over rows. Every op is out of
place: the caller's logits are never modified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from radixserve.engine.transfer import upload


def flat_token_index(
    rows: Sequence[int],
    token_lists: Sequence[Sequence[int]],
    vocab_size: int,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row index, token id) int64 pairs on the CPU, one per token; None if there are none."""
    lengths = [len(tokens) for tokens in token_lists]
    total = sum(lengths)
    if total == 0:
        return None
    # fromiter skips the intermediate Python list: ~3x faster than torch.tensor(list).
    ids = torch.from_numpy(
        np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=total)
    )
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{what} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    row_index = torch.repeat_interleave(
        torch.tensor(list(rows), dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    )
    return row_index, ids


def mark_seen(
    seen: torch.Tensor,
    rows: Sequence[int],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> None:
    """In place: seen[row, t] = True for every prompt and output token t of each row
    (`prompt_ids[i]`, `output_ids[i]` belong to `rows[i]`)."""
    # Two lists per row (prompt, output): no per-row concatenation.
    index = flat_token_index(
        [r for r in rows for _ in range(2)],
        [ids for pair in zip(prompt_ids, output_ids, strict=True) for ids in pair],
        seen.shape[1],
        "a prompt or output",
    )
    if index is not None:
        seen.index_put_(
            (upload(index[0], seen.device), upload(index[1], seen.device)),
            torch.ones((), dtype=torch.bool, device=seen.device),
        )


def add_counts(
    counts: torch.Tensor, rows: Sequence[int], output_ids: Sequence[Sequence[int]]
) -> None:
    """In place: counts[row, t] += occurrences of t in the row's `output_ids[i]`."""
    index = flat_token_index(rows, output_ids, counts.shape[1], "an output")
    if index is not None:
        ones = torch.ones(index[1].numel(), dtype=torch.float32, device=counts.device)
        # Counts are small integers: float32 atomics add them exactly, in any order.
        counts.index_put_(
            (upload(index[0], counts.device), upload(index[1], counts.device)),
            ones,
            accumulate=True,
        )


@dataclass(frozen=True)
class Penalties:
    """Per-row penalty factors ([m, 1] float32) and the token sets they apply to, for the
    m penalized rows of a batch (`rows`; None: m = bs, every row in order).

    A row without a penalty among them (repetition 1, frequency and presence 0) is left
    exactly as it is whatever its tensors hold: x / 1, x * 1 and x - 0 * count are x.
    """

    rows: torch.Tensor | None  # [m] int64 batch rows; None: the whole batch
    repetition: torch.Tensor | None  # [m, 1]; 1.0 for rows without the penalty
    seen_tokens: torch.Tensor | None  # [m, vocab] bool: in prompt or output
    frequency: torch.Tensor | None  # [m, 1]
    presence: torch.Tensor | None  # [m, 1]
    output_counts: torch.Tensor | None  # [m, vocab] float32: occurrences in the output
    state_rows: torch.Tensor | None = None  # [m] int64: their rows of a PenaltyState

    @classmethod
    def build(
        cls,
        repetition: Sequence[float],
        frequency: Sequence[float],
        presence: Sequence[float],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> Penalties | None:
        """From the token lists, over the whole batch; None when no row has a penalty."""
        bs = len(repetition)
        rep_rows = [r for r in range(bs) if repetition[r] != 1.0]
        count_rows = [r for r in range(bs) if frequency[r] != 0.0 or presence[r] != 0.0]
        if not rep_rows and not count_rows:
            return None
        rep = seen = freq = pres = counts = None
        if rep_rows:
            rep = _column(repetition, device)
            seen = torch.zeros((bs, vocab_size), dtype=torch.bool, device=device)
            mark_seen(
                seen, rep_rows, [prompt_ids[r] for r in rep_rows], [output_ids[r] for r in rep_rows]
            )
        if count_rows:
            freq, pres = _column(frequency, device), _column(presence, device)
            counts = torch.zeros((bs, vocab_size), dtype=torch.float32, device=device)
            add_counts(counts, count_rows, [output_ids[r] for r in count_rows])
        return cls(None, rep, seen, freq, pres, counts)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = logits if self.rows is None else logits.index_select(0, self.rows)
        if self.repetition is not None and self.seen_tokens is not None:
            # HF's RepetitionPenaltyLogitsProcessor: shrink positive logits, grow negative ones.
            penalized = torch.where(rows > 0, rows / self.repetition, rows * self.repetition)
            rows = torch.where(self.seen_tokens, penalized, rows)
        if self.output_counts is not None:
            assert self.frequency is not None and self.presence is not None
            rows = rows - self.frequency * self.output_counts
            rows = rows - self.presence * (self.output_counts > 0)
        return rows if self.rows is None else logits.index_copy(0, self.rows, rows)


@dataclass(frozen=True)
class LogitBias:
    """Each biased row's values added to its tokens' logits (OpenAI's `logit_bias`)."""

    flat_index: torch.Tensor  # [n] int64: row * vocab_size + token id
    values: torch.Tensor  # [n] float32

    @classmethod
    def build(
        cls,
        biases: Sequence[Mapping[int, float] | None],
        vocab_size: int,
        device: torch.device,
    ) -> LogitBias | None:
        rows = [r for r, bias in enumerate(biases) if bias]
        if not rows:
            return None
        token_lists = [list(biases[r] or {}) for r in rows]
        index = flat_token_index(rows, token_lists, vocab_size, "a logit_bias")
        assert index is not None
        values = [v for r in rows for v in (biases[r] or {}).values()]
        return cls(
            upload(index[0] * vocab_size + index[1], device),
            upload(torch.tensor(values, dtype=torch.float32), device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1).index_add(0, self.flat_index, self.values)
        return flat.view_as(logits)


@dataclass(frozen=True)
class StopTokenMask:
    """Stop ids set to -inf for rows still short of `min_new_tokens`."""

    flat_index: torch.Tensor  # [n] int64: row * vocab_size + token id

    @classmethod
    def build(
        cls,
        stop_ids: Sequence[Sequence[int]],
        output_lens: Sequence[int],
        min_new_tokens: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> StopTokenMask | None:
        rows = [r for r in range(len(stop_ids)) if output_lens[r] < min_new_tokens[r]]
        index = flat_token_index(rows, [stop_ids[r] for r in rows], vocab_size, "a stop set")
        if index is None:
            return None
        return cls(upload(index[0] * vocab_size + index[1], device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # index_fill takes a Python scalar: no host-to-device copy of the fill value.
        flat = logits.reshape(-1).index_fill(0, self.flat_index, float("-inf"))
        return flat.view_as(logits)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32, device=device).unsqueeze(1)
