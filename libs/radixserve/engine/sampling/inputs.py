"""`SamplingInput`: what the sampler and the penalty rows need of a request."""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Protocol

from radixserve.engine.sampling.params import SamplingParams


class SamplingInput(Protocol):
    """What the sampler needs of a request (the engine's `Req` has all of it)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def origin_input_ids(self) -> Sequence[int]: ...
    @property
    def output_ids(self) -> Sequence[int]: ...
    @property
    def stop_token_ids(self) -> Set[int]: ...  # eos (unless ignore_eos) + params.stop_token_ids
    @property
    def seed(self) -> int: ...  # resolved when the request was created (resolve_seed)
    @property
    def num_pending(self) -> int: ...  # outputs sampled but not in output_ids yet (overlap)
