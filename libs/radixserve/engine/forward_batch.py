"""What one model forward pass sees: the flattened tokens of a batch and where their KV goes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.engine.kvcache.pool import KVPool


# The rows of `ForwardBatch.decode_inputs`, in the order the CUDA graph runner keeps its
# static inputs, so a replay takes a decode batch's inputs in one copy.
DECODE_INPUT_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")


class ForwardMode(enum.Enum):
    # Every request adds one or more tokens after an optional cached prefix. Mixed
    # prefill+decode batches are EXTEND batches in which decode requests extend by 1.
    EXTEND = 1
    # Every request adds exactly one token (the mode decode CUDA graphs capture whole).
    DECODE = 2


@dataclass(frozen=True)
class SharedPrefix:
    """Requests of a decode batch whose KV begins with the same `length` slots (one path
    of the radix cache): cascade attention reads those slots once for all of them."""

    length: int
    members: tuple[int, ...]  # batch indices, at least two, each with seq_len > length


@dataclass
class ForwardBatch:
    """Flattened inputs of one forward pass.

    Tokens of all requests are concatenated in request order; request i owns
    input positions [extend_start_loc[i], extend_start_loc[i] + extend_seq_lens[i]).
    Its KV slots, prefix included, are req_to_token[req_pool_indices[i], :seq_lens[i]];
    the new tokens' slots are also given flat in out_cache_loc.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute position in the sequence
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot of each new token
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64, KV length after this pass (prefix + new)
    extend_prefix_lens: torch.Tensor  # [bs] int64, tokens already in KV before this pass
    extend_seq_lens: torch.Tensor  # [bs] int64, new tokens (1 for a decode request)
    extend_start_loc: torch.Tensor  # [bs] int64, offset of the request's first new token
    # [max_reqs + 1, max_context_len] int32, shared with ReqToTokenPool (the last row: padding)
    req_to_token: torch.Tensor
    kv_pool: KVPool
    # Host copies, so backends can size buffers without a device sync.
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    # Decode batches from the batch builder: [5, bs] int64 whose rows are the fields named
    # in DECODE_INPUT_FIELDS (those fields are views of its rows). None otherwise.
    decode_inputs: torch.Tensor | None = None
    # Groups of requests sharing a cached prefix, for a backend with
    # `supports_shared_prefix` (empty: attend to each request's KV on its own). Members
    # are among the `cascade_rows` leading one-token requests (a mixed batch puts its
    # decoding requests first).
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    # Prompt logprobs (sched/input_logprobs.py): flat token rows whose next-token logprobs
    # the model computes besides the logits, the tokens they score and the top logprobs a
    # row wants; the model leaves (chosen, top ids, top values) in `input_logprobs`.
    logprob_rows: torch.Tensor | None = None
    logprob_targets: torch.Tensor | None = None
    logprob_top: int = 0
    input_logprobs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def cascade_rows(self) -> int:
        """The leading requests that add one token each: the rows cascade attention runs
        (each one's token is the row of its batch index); the rest run as extends."""
        lens = self.extend_seq_lens_cpu
        return next((i for i, n in enumerate(lens) if n != 1), len(lens))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Index into the flat token axis of each request's last new token (where logits are taken)."""
        return self.extend_start_loc + self.extend_seq_lens - 1
