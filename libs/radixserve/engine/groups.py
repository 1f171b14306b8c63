"""What the engine tracks per caller request: its `n` choices and the shared prefill.

A caller's request (one `rid`) is a `RequestGroup` of `n` choices, each a `Req` the
scheduler runs (a resumed request: only its unfinished choices, each keeping its index).
With n > 1 and a prefix cache, a hidden prefill-only `Req` runs the prompt once first;
the choices are scheduled when it finishes and find the prompt in the cache.
`ChoiceOutput` is what one `Engine.step()` reports for one choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from radixserve.engine.request import FinishReason, Req, TokenLogprob


@dataclass(eq=False)
class RequestGroup:
    rid: str
    choices: list[Req]  # the choices it runs, choices[i] being choice indices[i]
    prefill: Req | None = None  # the hidden shared-prefix prefill while it runs
    started: float = field(default_factory=time.perf_counter)
    # 0..n-1, unless a resumed request runs only the choices that had not finished.
    indices: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.indices:
            self.indices = list(range(len(self.choices)))

    def indexed(self) -> list[tuple[int, Req]]:
        """(choice index, its `Req`) of each choice it runs."""
        return list(zip(self.indices, self.choices, strict=True))

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)


@dataclass
class ChoiceOutput:
    """New tokens (possibly none) of one choice in one step; `finished` on its last one."""

    rid: str
    index: int
    req: Req
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.req.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.req.finish_reason
