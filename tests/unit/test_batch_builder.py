"""The vectorised decode host path against the per-request code it replaced.

- `build_forward_batch` (one upload and one slot gather per step) gives exactly the
  ForwardBatch the per-request builder gave (kept below as the reference), for
  decode and mixed batches, page sizes 1 and 4, through whole engine runs with
  the radix cache, chunked prefill, retraction and seeded sampling.
- `KVManager.assign_decode_slots` (one allocation for the whole batch) leaves
  req_to_token, the free list and every output exactly as a loop of
  `assign_new_slots(req, 1)` does, the KV invariant checked after every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from radixserve.engine.forward_batch import (
    DECODE_INPUT_FIELDS,
    ForwardBatch,
    ForwardMode,
    SharedPrefix,
)
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.kvcache.radix_cache import RadixCache
from radixserve.engine.request import Req
from radixserve.engine.sampling.params import SamplingParams
from radixserve.engine.sched import batch_builder, scheduler
from radixserve.engine.sched.batch_builder import build_forward_batch, tokens_at
from radixserve.engine.sched.kv_manager import KVManager
from tests.unit.engine_helpers import make_prompts


def reference_build(
    reqs: list[Req], kv_pool: KVPool, req_pool: ReqToTokenPool, device: torch.device
) -> ForwardBatch:
    """The per-request builder as it was before the host path was vectorised."""
    input_ids: list[int] = []
    positions: list[int] = []
    prefix_lens: list[int] = []
    extend_lens: list[int] = []
    seq_lens: list[int] = []
    rows: list[int] = []
    for req in reqs:
        assert req.req_pool_idx is not None and req.extend_len > 0
        start, end = req.kv_len, req.kv_len + req.extend_len
        input_ids.extend(req.fill_ids[start:end])
        positions.extend(range(start, end))
        prefix_lens.append(start)
        extend_lens.append(req.extend_len)
        seq_lens.append(end)
        rows.append(req.req_pool_idx)
    starts = [0]
    for n in extend_lens[:-1]:
        starts.append(starts[-1] + n)
    table = req_pool.req_to_token
    out_cache_loc = torch.cat(
        [
            table[row, p : p + n].to(torch.int64)
            for row, p, n in zip(rows, prefix_lens, extend_lens, strict=True)
        ]
    )
    mode = ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)

    return ForwardBatch(
        mode=mode,
        input_ids=dev(input_ids),
        positions=dev(positions),
        out_cache_loc=out_cache_loc.to(device),
        req_pool_indices=dev(rows),
        seq_lens=dev(seq_lens),
        extend_prefix_lens=dev(prefix_lens),
        extend_seq_lens=dev(extend_lens),
        extend_start_loc=dev(starts),
        req_to_token=table,
        kv_pool=kv_pool,
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=extend_lens,
    )


_TENSOR_FIELDS = (
    "input_ids",
    "positions",
    "out_cache_loc",
    "req_pool_indices",
    "seq_lens",
    "extend_prefix_lens",
    "extend_seq_lens",
    "extend_start_loc",
)


def assert_same_batch(ours: ForwardBatch, ref: ForwardBatch) -> None:
    assert ours.mode == ref.mode
    for name in _TENSOR_FIELDS:
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype == torch.int64, name
        assert a.device == b.device, name
        assert torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"
    assert ours.seq_lens_cpu == ref.seq_lens_cpu
    assert ours.extend_prefix_lens_cpu == ref.extend_prefix_lens_cpu
    assert ours.extend_seq_lens_cpu == ref.extend_seq_lens_cpu
    assert ours.req_to_token is ref.req_to_token and ours.kv_pool is ref.kv_pool
    assert torch.equal(ours.last_token_indices, ref.last_token_indices)
    # Decode batches also carry their graph inputs as one tensor, row by row the fields.
    assert (ours.decode_inputs is not None) == (ours.mode == ForwardMode.DECODE)
    if ours.decode_inputs is not None:
        assert ours.decode_inputs.shape == (len(DECODE_INPUT_FIELDS), ours.batch_size)
        for row, name in enumerate(DECODE_INPUT_FIELDS):
            assert torch.equal(ours.decode_inputs[row], getattr(ours, name)), name


def _req(rid: str, prompt: list[int], outputs: list[int] | None = None) -> Req:
    return Req(
        rid=rid,
        origin_input_ids=prompt,
        params=SamplingParams(),
        seed=0,
        stop_token_ids=frozenset(),
        output_ids=list(outputs or []),
    )


# -- tokens_at --------------------------------------------------------------------------
def test_tokens_at_spans_prompt_and_output() -> None:
    req = _req("r", [10, 11, 12], [20, 21])
    for start in range(6):
        for end in range(start, 6):
            assert tokens_at(req, start, end) == req.fill_ids[start:end], (start, end)


# -- slot assignment, by hand -----------------------------------------------------------
def _manager(page_size: int, slots: int = 128) -> KVManager:
    pool = KVPool(slots, 1, 1, 1, torch.float32, "cpu", page_size=page_size, debug=True)
    return KVManager(pool, ReqToTokenPool(8, 64, "cpu"), RadixCache(pool))


def _admitted(kv: KVManager, prompts: list[list[int]]) -> list[Req]:
    """Requests with their prompts in KV, as after a prefill."""
    reqs = []
    for i, prompt in enumerate(prompts):
        req = _req(f"r{i}", prompt)
        kv.match(req)
        kv.admit(req)
        kv.assign_new_slots(req, len(prompt))
        req.kv_len = len(prompt)
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_assign_decode_slots_equals_one_call_per_request(page_size: int) -> None:
    # Prompt lengths put the requests at every offset of a page: some take a new page
    # at their next token, some the slot after their last one.
    lengths = [4, 5, 7, 8, 1, 6]
    states = []
    for batched in (False, True):
        kv = _manager(page_size)
        reqs = _admitted(kv, make_prompts(1000, lengths, seed=1))
        for _ in range(6):  # every request crosses a page end at least once
            if batched:
                kv.assign_decode_slots(reqs)
            else:
                for req in reqs:
                    kv.assign_new_slots(req, 1)
            for req in reqs:
                req.kv_len += 1
                req.output_ids.append(7)
            kv.check_invariants(reqs)
        states.append((kv.req_pool.req_to_token.clone(), kv.kv_pool.free_page_ids()))
    (table_loop, free_loop), (table_batch, free_batch) = states
    assert torch.equal(table_batch, table_loop)
    assert free_batch == free_loop


def test_assign_decode_slots_evicts_what_the_batch_needs() -> None:
    kv = _manager(page_size=4, slots=48)  # 12 pages
    done = _admitted(kv, make_prompts(1000, [16], seed=2))[0]
    kv.release(done)  # its 4 pages stay cached, evictable
    reqs = _admitted(kv, make_prompts(1000, [8, 12], seed=3))  # 5 pages; 3 free
    free_before = kv.kv_pool.available()
    assert free_before == 12 and kv.cache.sizes().evictable_tokens == 16
    for req in reqs:
        req.output_ids.append(7)
    kv.assign_decode_slots(reqs)  # two new pages from the free list
    for req in reqs:
        req.kv_len += 1
    kv.check_invariants(reqs)
    assert kv.kv_pool.available() == free_before - 8
    kv.kv_pool.alloc(kv.kv_pool.available())  # use up the free list: the next needs eviction
    for _ in range(3):  # fill the two new pages
        kv.assign_decode_slots(reqs)
        for req in reqs:
            req.kv_len += 1
    assert kv.kv_pool.available() == 0
    kv.assign_decode_slots(reqs)  # two pages, both evicted from the cache
    assert kv.cache.sizes().evictable_tokens <= 16 - 8
    slots = [int(kv.req_pool.req_to_token[r.req_pool_idx, r.kv_len]) for r in reqs]  # type: ignore[index]
    assert all(s % 4 == 0 and s >= 4 for s in slots) and slots[0] != slots[1]


# -- the builder, by hand ---------------------------------------------------------------
def _decoding(kv: KVManager, prompts: list[list[int]], outputs: list[list[int]]) -> list[Req]:
    """Requests about to decode their last output token (its slot assigned)."""
    reqs = []
    for i, (prompt, outs) in enumerate(zip(prompts, outputs, strict=True)):
        req = _req(f"d{i}", prompt, outs)
        kv.match(req)
        kv.admit(req)
        kv.assign_new_slots(req, req.seq_len - 1)
        req.kv_len = req.seq_len - 1
        reqs.append(req)
    kv.assign_decode_slots(reqs)
    for req in reqs:
        req.extend_len = 1
    return reqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_and_mixed_batches_equal_the_reference(page_size: int) -> None:
    kv = _manager(page_size)
    decoders = _decoding(kv, make_prompts(1000, [5, 9, 1], seed=4), [[3], [4, 5, 6, 8], [9]])
    device = torch.device("cpu")
    args = (kv.kv_pool, kv.req_pool, device)
    batch = build_forward_batch(decoders, *args)
    assert batch.mode == ForwardMode.DECODE
    assert_same_batch(batch, reference_build(decoders, *args))
    assert batch.input_ids.tolist() == [3, 8, 9]
    # A request mid-chunk (4 of 11 prompt tokens in KV) and a new one, among decoders.
    extenders = []
    for i, (prompt, done, n) in enumerate(
        zip(make_prompts(1000, [11, 3], seed=5), [4, 0], [7, 3], strict=True)
    ):
        req = _req(f"e{i}", prompt)
        kv.match(req)
        kv.admit(req)
        if done:
            kv.assign_new_slots(req, done)
            req.kv_len = done
        kv.assign_new_slots(req, n)
        req.extend_len = n
        extenders.append(req)
    mixed = decoders[:1] + extenders[:1] + decoders[1:] + extenders[1:]
    batch = build_forward_batch(mixed, *args)
    assert batch.mode == ForwardMode.EXTEND
    assert_same_batch(batch, reference_build(mixed, *args))


# -- whole engine runs ------------------------------------------------------------------
def _params(i: int) -> dict[str, Any]:
    if i % 3 == 2:  # seeded sampling, so retraction and chunking replay the same draws
        return {"max_new_tokens": 12, "temperature": 0.8, "seed": 100 + i, "ignore_eos": True}
    return {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_steps_equal_the_per_request_path(
    tiny_llama_dir: Path, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines in lockstep: one with batched decode slots, one with a loop of
    assign_new_slots; every ForwardBatch either builds is compared to the reference
    builder, and the KV tables, free lists and outputs must agree after every step."""
    built = {"decode": 0, "mixed": 0}

    def checked_build(
        reqs: list[Req],
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        device: torch.device,
        shared_prefixes: tuple[SharedPrefix, ...] = (),
    ) -> ForwardBatch:
        assert shared_prefixes == ()  # the torch backend has no cascade attention
        batch = batch_builder.build_forward_batch(reqs, kv_pool, req_pool, device)
        assert_same_batch(batch, reference_build(reqs, kv_pool, req_pool, device))
        if batch.mode == ForwardMode.DECODE:
            built["decode"] += 1
        elif 1 in batch.extend_seq_lens_cpu:
            built["mixed"] += 1
        return batch

    monkeypatch.setattr(scheduler, "build_forward_batch", checked_build)
    engines = [
        Engine(
            model_path=str(tiny_llama_dir),
            device="cpu",
            dtype="float32",
            page_size=page_size,
            max_total_tokens=48,  # forces retraction, and eviction of cached pages
            chunked_prefill_size=16,  # long prompts ride along with decoders
            debug_check_invariants=True,
        )
        for _ in range(2)
    ]
    loop_kv = engines[0].scheduler.kv

    def per_request(reqs: list[Req]) -> None:
        for req in reqs:
            loop_kv.assign_new_slots(req, 1)

    loop_kv.assign_decode_slots = per_request  # type: ignore[method-assign]
    vocab = engines[0].runner.vocab_size
    prompts = make_prompts(vocab, [5, 30, 3, 17, 9], seed=11)
    for engine in engines:
        for i, prompt in enumerate(prompts):
            engine.submit(prompt, _params(i), rid=f"q{i}")
    outputs: list[dict[str, list[int]]] = [{}, {}]
    while engines[0].has_work() or engines[1].has_work():
        for engine, seen in zip(engines, outputs, strict=True):
            for out in engine.step():
                seen.setdefault(out.rid, []).extend(out.new_token_ids)
        tables = [e.runner.req_pool.req_to_token for e in engines]
        assert torch.equal(tables[0], tables[1])
        assert (
            engines[0].runner.kv_pool.free_page_ids() == engines[1].runner.kv_pool.free_page_ids()
        )
    assert outputs[0] == outputs[1]
    assert all(len(ids) == 12 for ids in outputs[1].values()) and len(outputs[1]) == len(prompts)
    assert engines[1].scheduler.total_retractions > 0, "the pool was meant to force retraction"
    assert built["decode"] > 0 and built["mixed"] > 0
