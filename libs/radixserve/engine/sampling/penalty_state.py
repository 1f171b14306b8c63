"""Penalty state kept on the device across steps (SGLang's BatchedPenalizerOrchestrator).

A request with a penalty (`SamplingParams.has_penalty`) gets one row of two tensors when
it is first sampled: `seen` ([rows, vocab] bool: its prompt and output tokens) and
`counts` ([rows, vocab] float32: occurrences in its output), built once from its token
lists with `mark_seen` / `add_counts`, the scatters `Penalties.build` uses. A step gathers
its batch's rows (one index per tensor) and, right after sampling, `accept` adds the
sampled ids on the device: the state holds a token still pending under overlap
scheduling before the host has read it. The scheduler drops a request's row when it
finishes, aborts or is retracted (jump-forward retracts too, after appending forced
tokens on the host); its next sample builds the row again from the token lists.

Requests without penalties take no row and cost nothing. The tensors grow (doubling, up
to `max_rows`: the most requests that run at once) when rows run out and are freed with
the last row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.engine.sampling.inputs import SamplingInput
from radixserve.engine.sampling.penalties import Penalties, add_counts, mark_seen
from radixserve.engine.transfer import upload, upload_int64

MIN_ROWS = 8


class PenaltyState:
    """Rows of seen tokens and output counts, one per live penalized request."""

    def __init__(self, vocab_size: int, device: torch.device, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_rows = max_rows  # a bound for doubling, not a limit: past it rows come one by one
        self._rows: dict[SamplingInput, int] = {}  # keyed by identity (Req has eq=False)
        self._free: list[int] = []
        self._seen: torch.Tensor | None = None  # [capacity, vocab] bool
        self._counts: torch.Tensor | None = None  # [capacity, vocab] float32

    @property
    def capacity(self) -> int:
        """Rows allocated on the device (0 while no penalized request is live)."""
        return 0 if self._seen is None else int(self._seen.shape[0])

    def holds(self, req: SamplingInput) -> bool:
        return req in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def gather(self, reqs: Sequence[SamplingInput]) -> Penalties | None:
        """The batch's penalties from the state; a penalized request without a row gets
        one, built from its token lists (it must have no token pending)."""
        batch_rows = [r for r, req in enumerate(reqs) if req.params.has_penalty]
        if not batch_rows:
            return None
        penalized = [reqs[r] for r in batch_rows]
        new = [req for req in penalized if req not in self._rows]
        if new:
            self._add(new)
        assert self._seen is not None and self._counts is not None
        m = len(batch_rows)
        index = upload_int64(batch_rows + [self._rows[req] for req in penalized], self.device)
        rows, state_rows = index[:m], index[m:]
        params = [req.params for req in penalized]
        factors = upload(
            torch.tensor(
                [
                    [p.repetition_penalty for p in params],
                    [p.frequency_penalty for p in params],
                    [p.presence_penalty for p in params],
                ],
                dtype=torch.float32,
            ),
            self.device,
        ).unsqueeze(2)
        use_seen = any(p.repetition_penalty != 1.0 for p in params)
        use_counts = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        return Penalties(
            rows=None if m == len(reqs) else rows,
            repetition=factors[0] if use_seen else None,
            seen_tokens=self._seen.index_select(0, state_rows) if use_seen else None,
            frequency=factors[1] if use_counts else None,
            presence=factors[2] if use_counts else None,
            output_counts=self._counts.index_select(0, state_rows) if use_counts else None,
            state_rows=state_rows,
        )

    def accept(self, penalties: Penalties | None, next_ids: torch.Tensor) -> None:
        """Add the step's sampled ids ([bs] on the device) to the gathered rows; nothing
        is read back to the host."""
        if penalties is None or penalties.state_rows is None:
            return
        assert self._seen is not None and self._counts is not None
        tokens = next_ids if penalties.rows is None else next_ids.index_select(0, penalties.rows)
        index = (penalties.state_rows, tokens)
        self._seen.index_put_(index, torch.ones((), dtype=torch.bool, device=self.device))
        # A request has one row, so no two pairs of a step coincide; accumulate anyway.
        self._counts.index_put_(index, torch.ones_like(tokens, dtype=torch.float32), True)

    def release(self, req: SamplingInput) -> None:
        """Drop the request's row, if it has one (finished, aborted, retracted)."""
        row = self._rows.pop(req, None)
        if row is None:
            return
        self._free.append(row)
        if not self._rows:
            self._seen = self._counts = None
            self._free.clear()

    def check(self, live: Sequence[SamplingInput]) -> None:
        """Debug: the rows belong to exactly the penalized `live` requests, and the row of
        each one with no token pending equals a rebuild from its token lists."""
        penalized = [req for req in live if req.params.has_penalty]
        assert set(self._rows) == set(penalized), "penalty rows and live requests disagree"
        held = sorted(self._rows.values())
        assert sorted(held + self._free) == list(range(self.capacity)), "penalty rows leaked"
        settled = [req for req in penalized if req.num_pending == 0]
        if not settled:
            return
        assert self._seen is not None and self._counts is not None
        seen = torch.zeros((len(settled), self.vocab_size), dtype=torch.bool, device=self.device)
        counts = torch.zeros(seen.shape, dtype=torch.float32, device=self.device)
        self._fill(seen, counts, range(len(settled)), settled)
        index = upload_int64([self._rows[req] for req in settled], self.device)
        assert torch.equal(self._seen.index_select(0, index), seen), "seen tokens drifted"
        assert torch.equal(self._counts.index_select(0, index), counts), "output counts drifted"

    def _add(self, new: list[SamplingInput]) -> None:
        assert all(req.num_pending == 0 for req in new), "building a row past a pending token"
        if len(new) > len(self._free):
            self._grow(len(new) - len(self._free))
        assert self._seen is not None and self._counts is not None
        rows = [self._free.pop() for _ in new]
        self._rows.update(zip(new, rows, strict=True))
        index = upload_int64(rows, self.device)
        self._seen.index_fill_(0, index, False)
        self._counts.index_fill_(0, index, 0.0)
        self._fill(self._seen, self._counts, rows, new)

    @staticmethod
    def _fill(
        seen: torch.Tensor,
        counts: torch.Tensor,
        rows: Sequence[int],
        reqs: Sequence[SamplingInput],
    ) -> None:
        outputs = [req.output_ids for req in reqs]
        mark_seen(seen, rows, [req.origin_input_ids for req in reqs], outputs)
        add_counts(counts, rows, outputs)

    def _grow(self, need: int) -> None:
        old = self.capacity
        size = max(min(max(2 * old, MIN_ROWS), self.max_rows), old + need)
        seen = torch.zeros((size, self.vocab_size), dtype=torch.bool, device=self.device)
        counts = torch.zeros((size, self.vocab_size), dtype=torch.float32, device=self.device)
        if self._seen is not None and self._counts is not None:
            seen[:old] = self._seen
            counts[:old] = self._counts
        self._seen, self._counts = seen, counts
        self._free.extend(range(size - 1, old - 1, -1))  # pop() hands out the lowest first
