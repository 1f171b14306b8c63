"""The triton attention backend against the torch backend: same pool, same batch, same
outputs and the same KV writes. On the CPU the kernels run under the Triton interpreter.

Triton picks the interpreter when a kernel is defined, from TRITON_INTERPRET as it
stands then, so the variable is set before anything imports the kernels. Where another
module imported them compiled first (the GPU tests, on a CUDA machine), these tests
run compiled on CUDA instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the dev extra brings it on Linux)")

from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.attention.triton_ops.common import INTERPRETED
from radixserve.engine.attention.triton_ops.decode import num_kv_splits
from radixserve.engine.config import EngineConfig
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.runner import make_attention_backend
from tests.helpers import attention_passes, decode_cases
from tests.helpers.attention_passes import Pass
from tests.helpers.triton_interpreter import skip_unless_interpreted_or_cuda

skip_unless_interpreted_or_cuda()

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
LAYER = 1  # not layer 0, so a backend that ignores layer_id reads the wrong buffers
FP32_MAX_REL_ERROR = 1e-4


def make_pass(prefix_lens: list[int], extend_lens: list[int], **kwargs: Any) -> Pass:
    return attention_passes.make_pass(prefix_lens, extend_lens, device=DEVICE, **kwargs)


def compare_with_torch(p: Pass, layers: tuple[int, ...] = (LAYER,)) -> float:
    return attention_passes.compare_with_torch(p, TritonAttentionBackend(DEVICE), layers)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_decode_matches_torch(mode: ForwardMode, page_size: int) -> None:
    # 600 keys -> 4 splits; the 1- and 2-key requests leave trailing splits empty.
    prefix_lens = [0, 1, 36, 299, 599]
    assert num_kv_splits(600) == 4
    p = make_pass(
        prefix_lens, [1] * 5, mode=mode, page_size=page_size, seed=1 + page_size + mode.value
    )
    assert compare_with_torch(p) < FP32_MAX_REL_ERROR


@pytest.mark.parametrize(
    "dtype,tolerance", [(torch.float32, FP32_MAX_REL_ERROR), (torch.float16, 5e-3)], ids=str
)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 2)], ids=["gqa4", "group_of_3"])
def test_one_split_writes_out_in_one_pass(
    heads: int, kv_heads: int, dtype: torch.dtype, tolerance: float
) -> None:
    # The decode rows of a mixed batch (not 0..bs-1), ragged lengths from 1 key to
    # several blocks (64 and 65 at a block's edge); the other rows must stay unwritten.
    case = decode_cases.make_case(
        [1, 37, 130, 9, 64, 65],
        [7, 2, 0, 9, 4, 5],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=32,
        dtype=dtype,
        device=DEVICE,
        seed=heads + kv_heads,
    )
    one_pass = decode_cases.run_kernel(case, 1)
    assert decode_cases.relative_error(case, one_pass) < tolerance
    # Stage 2 over one split only copies: the two paths agree bit for bit.
    two_stage = decode_cases.run_kernel(case, 1, two_stage=True)
    assert torch.equal(one_pass, two_stage)
    # Several splits (the 1-key request leaves three empty) through both stages.
    assert decode_cases.relative_error(case, decode_cases.run_kernel(case, 4)) < tolerance


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [([0, 0, 0], [5, 40, 70]), ([3, 33, 130], [9, 70, 2])],
    ids=["no_prefix", "cached_prefix"],
)
def test_extend_matches_torch(
    prefix_lens: list[int], extend_lens: list[int], page_size: int
) -> None:
    # 70 new tokens span several query and key blocks; 130 prefix keys several blocks.
    p = make_pass(prefix_lens, extend_lens, page_size=page_size, seed=sum(prefix_lens) + page_size)
    assert compare_with_torch(p) < FP32_MAX_REL_ERROR


def test_mixed_batch_matches_torch_on_every_layer() -> None:
    # Decodes (1 new token after a prefix) beside prefills and a chunk continuation.
    p = make_pass([50, 0, 7, 20, 0], [1, 45, 1, 3, 1], seed=5)
    assert compare_with_torch(p, layers=(0, 1)) < FP32_MAX_REL_ERROR


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "heads,kv_heads", [(8, 2), (6, 2), (4, 4)], ids=["gqa4", "group_of_3", "mha"]
)
def test_shared_prefix_decode_matches_torch(heads: int, kv_heads: int, page_size: int) -> None:
    # Batch order mixes the groups with a request outside any: group A of 3 members over
    # 300 shared slots (2 prefix splits, members with suffixes of 1 to 70 keys), group
    # B of 2 over 8; request 2 reads its 40 keys alone. Under the reference every
    # request reads its whole row, the shared slots included.
    prefix_lens = [370, 8, 40, 300, 20, 331]
    p = make_pass(
        prefix_lens,
        [1] * 6,
        mode=ForwardMode.DECODE,
        heads=heads,
        kv_heads=kv_heads,
        page_size=page_size,
        seed=11 + heads + page_size,
    )
    attention_passes.share_prefixes(p, [(300, [3, 0, 5]), (8, [4, 1])])
    assert compare_with_torch(p, layers=(0, 1)) < FP32_MAX_REL_ERROR


def test_shared_prefix_with_long_suffixes_merges_in_its_own_kernel() -> None:
    # Suffixes past 256 keys take several splits: the partials of both parts are then
    # folded by the merge kernel (with one suffix split the decode kernel folds the
    # prefix partials itself, as in the test above).
    p = make_pass([40 + 600, 40 + 3, 700], [1] * 3, mode=ForwardMode.DECODE, seed=23)
    attention_passes.share_prefixes(p, [(40, [1, 0])])
    assert compare_with_torch(p) < FP32_MAX_REL_ERROR


def test_shared_prefix_group_wider_than_a_tile() -> None:
    # 4 query heads per KV head stack 16 members in a 64-row tile: 20 members take two.
    p = make_pass([64 + i for i in range(20)], [1] * 20, mode=ForwardMode.DECODE, seed=21)
    attention_passes.share_prefixes(p, [(64, list(range(19, -1, -1)))])
    assert compare_with_torch(p) < FP32_MAX_REL_ERROR


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_decodes_beside_prefills_match_torch(page_size: int) -> None:
    # A mixed batch: five decoding requests first (groups over 300 and 8 slots, one
    # alone), then a 45-token prefill, a one-token chunk and a 3-token chunk after a
    # cached prefix: the leading five run cascade, the rest the extend kernel.
    p = make_pass(
        [370, 8, 40, 300, 20, 0, 16, 7],
        [1, 1, 1, 1, 1, 45, 1, 3],
        page_size=page_size,
        seed=31 + page_size,
    )
    attention_passes.share_prefixes(p, [(300, [3, 0]), (8, [4, 1])])
    assert p.batch.cascade_rows == 5
    assert compare_with_torch(p, layers=(0, 1)) < FP32_MAX_REL_ERROR


def test_shared_prefix_groups_are_checked() -> None:
    p = make_pass([10, 10], [1, 1], mode=ForwardMode.DECODE, seed=2)
    attention_passes.share_prefixes(p, [(8, [0, 1])])
    p.batch.shared_prefixes = (*p.batch.shared_prefixes, p.batch.shared_prefixes[0])
    with pytest.raises(ValueError, match="two groups"):
        TritonAttentionBackend(DEVICE).init_forward_metadata(p.batch)
    # Members must be among the leading one-token requests of a mixed batch.
    p = make_pass([10, 10, 10], [1, 4, 1], seed=3)
    attention_passes.share_prefixes(p, [(8, [0, 2])])
    with pytest.raises(ValueError, match="leading one-token"):
        TritonAttentionBackend(DEVICE).init_forward_metadata(p.batch)


@pytest.mark.parametrize(
    "heads,kv_heads",
    [(4, 4), (6, 2), (32, 1)],
    ids=["mha", "group_of_3", "group_wider_than_a_tile"],
)
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_head_layouts(heads: int, kv_heads: int, mode: ForwardMode) -> None:
    extend_lens = [1, 1, 1] if mode == ForwardMode.DECODE else [6, 1, 20]
    p = make_pass([4, 30, 0], extend_lens, heads=heads, kv_heads=kv_heads, mode=mode, seed=heads)
    assert compare_with_torch(p) < FP32_MAX_REL_ERROR


@pytest.mark.parametrize("head_dim", [64, 48])
def test_head_dims(head_dim: int) -> None:
    # 48 is not a power of two: the kernels pad it to 64 and mask.
    p = make_pass([0, 12], [10, 1], heads=4, kv_heads=2, head_dim=head_dim, seed=head_dim)
    assert compare_with_torch(p) < FP32_MAX_REL_ERROR
    decode = make_pass([9, 40], [1, 1], heads=4, kv_heads=2, head_dim=head_dim, seed=7)
    assert compare_with_torch(decode) < FP32_MAX_REL_ERROR


def test_float16_close_to_torch() -> None:
    # Both sides round q/k/v the same way; they differ in where they round the
    # probabilities (triton feeds them to the PV product in float16).
    for mode, extend_lens in [(ForwardMode.EXTEND, [12, 1, 30]), (ForwardMode.DECODE, [1, 1, 1])]:
        p = make_pass([0, 20, 64], extend_lens, dtype=torch.float16, mode=mode, seed=3)
        assert compare_with_torch(p) < 5e-3


@pytest.mark.skipif(not INTERPRETED, reason="compiled kernels multiply bfloat16")
def test_bfloat16_is_refused_under_the_interpreter() -> None:
    # The interpreter's dot has no bfloat16 (the GPU tests cover it compiled).
    p = make_pass([0], [3], dtype=torch.bfloat16, seed=0)
    backend = TritonAttentionBackend(DEVICE)
    backend.init_forward_metadata(p.batch)
    with pytest.raises(ValueError, match="bfloat16"):
        backend.forward(p.q, p.k, p.v, LAYER, p.batch, p.scale)


def test_inconsistent_batches_are_rejected() -> None:
    p = make_pass([2, 0], [3, 1], seed=0)
    p.batch.seq_lens_cpu = [4, 1]  # prefix 2 + 3 new would be 5
    with pytest.raises(ValueError, match="seq_len"):
        TritonAttentionBackend(DEVICE).init_forward_metadata(p.batch)
    p = make_pass([2, 0], [3, 1], mode=ForwardMode.DECODE, seed=0)
    with pytest.raises(ValueError, match="DECODE"):
        TritonAttentionBackend(DEVICE).init_forward_metadata(p.batch)


def test_forward_before_metadata_is_an_error() -> None:
    p = make_pass([0], [3], seed=0)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        TritonAttentionBackend(DEVICE).forward(p.q, p.k, p.v, LAYER, p.batch, p.scale)


def test_config_and_factory_pick_the_backend() -> None:
    assert EngineConfig(attention_backend="triton").attention_backend == "triton"
    assert EngineConfig(attention_backend="auto").attention_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="cudnn")
    assert isinstance(make_attention_backend("triton", DEVICE), TritonAttentionBackend)
    assert isinstance(make_attention_backend("torch", DEVICE), TorchAttentionBackend)
    # On the CPU "auto" means the torch reference: the interpreter is for tests only.
    cpu = torch.device("cpu")
    assert isinstance(make_attention_backend("auto", cpu), TorchAttentionBackend)


@pytest.mark.slow
def test_engine_greedy_outputs_equal_the_torch_backend(tiny_llama_dir: Path) -> None:
    # Chunks of 16 put chunk continuations (cached prefix + new tokens) and mixed
    # decode + prefill batches through both kernels; then decode steps. (The engine's
    # imports stay in here, so the kernel tests need only torch and triton.)
    from radixserve import Engine
    from tests.unit.engine_helpers import engine_outputs, make_prompts

    def outputs(backend: str) -> list[list[int]]:
        engine = Engine(
            model_path=str(tiny_llama_dir),
            device=DEVICE.type,
            dtype="float32",
            attention_backend=backend,
            chunked_prefill_size=16,
            max_total_tokens=512,
        )
        try:
            return engine_outputs(engine, prompts, 6)
        finally:
            engine.shutdown()

    prompts = make_prompts(1000, [5, 23, 40], seed=4)
    assert outputs("triton") == outputs("torch")


@pytest.mark.slow
def test_engine_greedy_outputs_with_kv_stored_by_the_rotary_kernel(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every fused op on its kernel (the CUDA path, interpreted): the rotary kernel
    # storing each layer's K/V gives the tokens of rotary then the backend's store.
    from radixserve import Engine
    from radixserve.engine.kernels import dispatch
    from radixserve.engine.model import llama
    from tests.helpers.fused_kernel_cases import rotary_without_store
    from tests.unit.engine_helpers import engine_outputs, make_prompts

    def outputs() -> list[list[int]]:
        engine = Engine(
            model_path=str(tiny_llama_dir),
            device=DEVICE.type,
            dtype="float32",
            attention_backend="triton",
            chunked_prefill_size=16,
            max_total_tokens=512,
        )
        try:
            return engine_outputs(engine, prompts, 3)
        finally:
            engine.shutdown()

    prompts = make_prompts(1000, [4, 18], seed=4)
    monkeypatch.setattr(dispatch, "use_triton", lambda x: True)
    fused = outputs()
    monkeypatch.setattr(llama, "apply_rotary_and_store", rotary_without_store)
    assert fused == outputs()


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_cascade_steps_equal_the_torch_backend(tiny_llama_dir: Path, page_size: int) -> None:
    # Four prompts over one 72-token system prompt and one unrelated prompt: once their
    # prefills are cached the four share a radix node, and their decode steps run
    # cascade attention (no graphs on the CPU, so any saving is worth it).
    from radixserve import Engine
    from tests.unit.engine_helpers import engine_outputs, make_prompts

    system, *questions = make_prompts(1000, [72, 5, 9, 3, 12, 30], seed=6)
    prompts = [system + q for q in questions[:4]] + [questions[4]]

    def run(backend: str, disable_cascade: bool = False) -> tuple[list[list[int]], int]:
        engine = Engine(
            model_path=str(tiny_llama_dir),
            device=DEVICE.type,
            dtype="float32",
            attention_backend=backend,
            page_size=page_size,
            max_total_tokens=1024,
            disable_cascade_attention=disable_cascade,
        )
        try:
            return engine_outputs(engine, prompts, 6), engine.scheduler.total_cascade_steps
        finally:
            engine.shutdown()

    reference, none = run("torch")
    assert none == 0  # the torch backend has no cascade
    outputs, cascade_steps = run("triton")
    assert cascade_steps >= 4
    assert outputs == reference
    assert run("triton", disable_cascade=True) == (reference, 0)


@pytest.mark.slow
def test_engine_cascade_beside_a_chunked_prefill_equals_the_torch_backend(
    tiny_llama_dir: Path,
) -> None:
    # Four requests over one 72-token system prompt decode while a 40-token prompt
    # arrives and is prefilled 8 tokens a step beside them: those mixed steps run cascade
    # for the decoding rows (the leading ones) and the extend kernel for the chunk.
    from radixserve import Engine
    from radixserve.engine.attention import cascade
    from tests.unit.engine_helpers import greedy_params, make_prompts

    system, *questions = make_prompts(1000, [72, 5, 9, 3, 12, 40], seed=8)
    early = [system + q for q in questions[:4]]
    late = questions[4]

    def run(backend: str) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
        engine = Engine(
            model_path=str(tiny_llama_dir),
            device=DEVICE.type,
            dtype="float32",
            attention_backend=backend,
            max_total_tokens=1024,
            chunked_prefill_size=8,
            debug_check_invariants=True,
        )
        rows: list[tuple[int, int]] = []  # (cascade rows, batch size) of each cascade pass
        original = cascade.CascadeDecode.__init__

        def record(self: cascade.CascadeDecode, batch: Any) -> None:
            original(self, batch)
            rows.append((self.rows, batch.batch_size))

        outputs: dict[str, list[int]] = {}
        try:
            cascade.CascadeDecode.__init__ = record  # type: ignore[method-assign]
            rids = [engine.submit(p, greedy_params(12)) for p in early]
            while not any(outputs.get(rid) for rid in rids):  # until the first decodes
                for out in engine.step():
                    outputs.setdefault(out.rid, []).extend(out.new_token_ids)
            rids.append(engine.submit(late, greedy_params(4)))
            while engine.has_work():
                for out in engine.step():
                    outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        finally:
            cascade.CascadeDecode.__init__ = original  # type: ignore[method-assign]
            engine.shutdown()
        return {f"r{i}": outputs[rid] for i, rid in enumerate(rids)}, rows

    reference, _ = run("torch")
    outputs, passes = run("triton")
    assert outputs == reference
    assert all(len(ids) == (12 if i < 4 else 4) for i, ids in enumerate(outputs.values()))
    assert any(rows < bs for rows, bs in passes), "no mixed step ran cascade"
