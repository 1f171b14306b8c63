"""KV transfer between two pools: run coalescing, layouts, and real Mooncake TCP writes
between two processes (this one and a spawned receiver), checked bit for bit."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
import torch

from radixserve.engine.kvcache.pool import KVPool
from radixserve.kv_transfer import (
    KVLayoutMismatch,
    KVPoolLayout,
    KVTransferError,
    MooncakeTransfer,
    SlotRun,
    coalesce_runs,
)

try:
    import mooncake.engine  # noqa: F401

    _MOONCAKE_MISSING = ""
except ImportError as e:  # the package, or libibverbs.so.1 that its library links
    _MOONCAKE_MISSING = str(e)

needs_mooncake = pytest.mark.skipif(
    bool(_MOONCAKE_MISSING),
    reason="Mooncake transfer engine not importable (pip install "
    f"mooncake-transfer-engine-non-cuda; apt-get install libibverbs1): {_MOONCAKE_MISSING}",
)

TOKENS = 12  # slots moved per write
REPLY_S = 60  # how long to wait for the receiver before calling it dead


def _tiny_pool(
    page_size: int, head_dim: int = 8, dtype: torch.dtype = torch.bfloat16, num_slots: int = 64
) -> KVPool:
    return KVPool(num_slots, 2, 2, head_dim, dtype, "cpu", page_size=page_size)


# -- run coalescing (pure) --------------------------------------------------------------


def test_coalesce_merges_only_runs_consecutive_on_both_sides() -> None:
    src = [4, 5, 6, 9, 10, 11, 12]
    dst = [20, 21, 8, 9, 10, 30, 31]
    assert coalesce_runs(src, dst) == [
        SlotRun(4, 20, 2),
        SlotRun(6, 8, 1),  # src follows on, dst jumps
        SlotRun(9, 9, 2),  # dst follows on, src jumps
        SlotRun(11, 30, 2),
    ]
    assert coalesce_runs([], []) == []
    assert coalesce_runs([3], [7]) == [SlotRun(3, 7, 1)]
    with pytest.raises(ValueError, match="2 source slots for 1"):
        coalesce_runs([1, 2], [3])


def test_coalesce_covers_every_pair_with_maximal_runs() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(0, 40)
        src = sorted(rng.sample(range(100), n))
        dst = [d + rng.choice([0, 0, 0, 5]) for d in range(n)]
        runs = coalesce_runs(src, dst)
        pairs = [(r.src + i, r.dst + i) for r in runs for i in range(r.length)]
        assert pairs == list(zip(src, dst, strict=True))
        for a, b in itertools.pairwise(runs):
            assert not (b.src == a.src + a.length and b.dst == a.dst + a.length)


# -- layouts (pure) ---------------------------------------------------------------------


def test_layout_of_pool_addresses_each_slot_row() -> None:
    pool = _tiny_pool(page_size=4)
    layout = KVPoolLayout.of(pool, "127.0.0.1:1")
    assert layout.k_addrs == tuple(b.data_ptr() for b in pool.k_buffers)
    assert layout.v_addrs == tuple(b.data_ptr() for b in pool.v_buffers)
    assert (layout.num_layers, layout.page_size, layout.dtype) == (2, 4, "bfloat16")
    assert layout.bytes_per_slot == 2 * 8 * 2
    assert layout.num_rows == pool.size + 4
    row = pool.k_buffers[1][13]
    assert row.data_ptr() == layout.k_addrs[1] + 13 * layout.bytes_per_slot


def test_layouts_must_agree_on_row_meaning_not_page_size() -> None:
    base = KVPoolLayout.of(_tiny_pool(page_size=1), "a:1")
    base.check_compatible(KVPoolLayout.of(_tiny_pool(page_size=4), "b:2"))
    for other in (_tiny_pool(1, head_dim=16), _tiny_pool(1, dtype=torch.float16)):
        with pytest.raises(KVLayoutMismatch, match="a:1 has"):
            base.check_compatible(KVPoolLayout.of(other, "b:2"))


# -- real transfers through Mooncake TCP ------------------------------------------------


def _row_bytes(buffer: torch.Tensor, slots: list[int]) -> list[bytes]:
    return [bytes(buffer[s].view(torch.uint8).numpy()) for s in slots]


def _receive_rounds(conn: Connection) -> None:
    """Process B: per round (page size, pool slots, tokens), a fresh pool the sender
    writes into; checks what landed against what was sent. Exits on None."""
    transfer = MooncakeTransfer()
    transfer.start(timeout_s=5)
    while (round_ := conn.recv()) is not None:
        page_size, num_slots, tokens = round_
        pool = _tiny_pool(page_size, num_slots=num_slots)
        conn.send(transfer.register_pool(pool))
        # Non-contiguous destination: the last of 2n fresh pages, then pages 2..n.
        n = tokens // page_size
        pages = pool.alloc_pages(2 * n)
        assert pages is not None
        chosen = [int(pages[-1])] + [int(p) for p in pages[1:n]]
        dst_slots = [p * page_size + o for p in chosen for o in range(page_size)]
        conn.send(dst_slots)
        sent_k, sent_v = conn.recv()  # after the sender's write returned
        conn.send(_check_rows(pool, dst_slots, sent_k, sent_v))
    transfer.close()


def _check_rows(
    pool: KVPool, dst_slots: list[int], sent_k: list[list[bytes]], sent_v: list[list[bytes]]
) -> list[str]:
    failures = []
    others = [s for s in range(pool.size + pool.page_size) if s not in dst_slots]
    for layer in range(pool.num_layers):
        for name, buffer, sent in (("K", pool.k_buffers, sent_k), ("V", pool.v_buffers, sent_v)):
            if _row_bytes(buffer[layer], dst_slots) != sent[layer]:
                failures.append(f"layer {layer} {name}: written rows differ from those sent")
            if buffer[layer][others].any():
                failures.append(f"layer {layer} {name}: rows outside dst_slots were written")
    return failures


class _Receiver:
    """A spawned process B and the pipe to it."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=_receive_rounds, args=(there,), daemon=True)
        self.proc.start()

    def recv(self) -> object:
        assert self.conn.poll(REPLY_S), "receiver process did not answer"
        return self.conn.recv()

    def stop(self) -> int | None:
        self.conn.send(None)
        self.proc.join(REPLY_S)
        return self.proc.exitcode


@pytest.fixture
def sender() -> Iterator[MooncakeTransfer]:
    transfer = MooncakeTransfer()
    transfer.start(timeout_s=5)
    yield transfer
    transfer.close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[_Receiver]:
    # One process for every round: spawning one (and importing torch) costs ~3 s.
    peer = _Receiver()
    yield peer
    assert peer.stop() == 0


def _filled_source(pool: KVPool, tokens: int, scattered: bool) -> list[int]:
    """Random K/V in `tokens` non-contiguous slots: pages 1 and 3.. of the pool, or
    (scattered) every other page, so that each page is a run of its own."""
    n = tokens // pool.page_size
    pages = pool.alloc_pages(2 * n if scattered else n + 1)
    assert pages is not None
    chosen = (
        [int(p) for p in pages[::2]] if scattered else [int(pages[0])] + [int(p) for p in pages[2:]]
    )
    slots = [p * pool.page_size + o for p in chosen for o in range(pool.page_size)]
    gen = torch.Generator().manual_seed(pool.page_size)
    for buffers in (pool.k_buffers, pool.v_buffers):
        for buffer in buffers:
            buffer[slots] = torch.randn(buffer[slots].shape, generator=gen).to(buffer.dtype)
    return slots


def _write_and_check(
    sender: MooncakeTransfer,
    pool: KVPool,
    peer: _Receiver,
    dst_page: int,
    tokens: int = TOKENS,
    scattered: bool = False,
) -> tuple[KVPoolLayout, KVPoolLayout, list[int], list[int]]:
    """Write source slots into a fresh pool of the receiver's (as large as the sender's)
    and have it check them; the layouts and slots used, for writing again."""
    local = sender.register_pool(pool)
    src_slots = _filled_source(pool, tokens, scattered)
    peer.conn.send((dst_page, pool.size, tokens))
    remote = peer.recv()
    dst_slots = peer.recv()
    assert isinstance(remote, KVPoolLayout) and isinstance(dst_slots, list)
    sender.write_slots(local, src_slots, remote, dst_slots)
    sent_k = [_row_bytes(b, src_slots) for b in pool.k_buffers]
    sent_v = [_row_bytes(b, src_slots) for b in pool.v_buffers]
    peer.conn.send((sent_k, sent_v))  # for the check only: the KV went through Mooncake
    assert peer.recv() == []
    return local, remote, src_slots, dst_slots


@needs_mooncake
@pytest.mark.parametrize(("src_page", "dst_page"), [(1, 1), (4, 4), (1, 4)])
def test_write_slots_lands_bit_equal_in_peer_slots(
    sender: MooncakeTransfer, receiver: _Receiver, src_page: int, dst_page: int
) -> None:
    _write_and_check(sender, _tiny_pool(src_page), receiver, dst_page)


@needs_mooncake
def test_write_slots_splits_more_requests_than_one_batch_takes(
    sender: MooncakeTransfer, receiver: _Receiver
) -> None:
    # 1200 runs x 2 layers x K and V: 4800 requests, past MAX_BATCH_REQUESTS.
    pool = _tiny_pool(1, num_slots=2500)
    _write_and_check(sender, pool, receiver, 1, tokens=1200, scattered=True)


@needs_mooncake
def test_write_to_exited_peer_raises(sender: MooncakeTransfer) -> None:
    peer = _Receiver()
    try:
        local, remote, src_slots, dst_slots = _write_and_check(sender, _tiny_pool(1), peer, 1)
    finally:
        assert peer.stop() == 0
    # Exited: refused or reset at once (a live peer that stops answering: timeout_s).
    with pytest.raises(KVTransferError, match=remote.session_id) as raised:
        sender.write_slots(local, src_slots, remote, dst_slots)
    assert raised.value.return_code != 0


@needs_mooncake
def test_write_slots_rejects_rows_outside_either_pool(sender: MooncakeTransfer) -> None:
    pool = _tiny_pool(1)
    local = sender.register_pool(pool)
    remote = KVPoolLayout.of(_tiny_pool(1), "127.0.0.1:1")
    with pytest.raises(ValueError, match="outside"):
        sender.write_slots(local, [1], remote, [local.num_rows])
    with pytest.raises(ValueError, match="outside"):
        sender.write_slots(local, [-1], remote, [1])
    with pytest.raises(KVLayoutMismatch):
        sender.write_slots(local, [1], KVPoolLayout.of(_tiny_pool(1, head_dim=16), "x:1"), [1])
