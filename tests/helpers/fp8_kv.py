"""Our model over an FP8 KV pool outside the engine: per-step logits and greedy tokens
with their top-2 gaps, the reference for the engine's FP8 cache (CPU and CUDA tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.kernels.fp8_format import FP8_DTYPE
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.model.kv_scales import checkpoint_kv_scales
from radixserve.engine.model.loader import load_model
from tests.helpers.batches import PagedRequests
from tests.unit.engine_helpers import Reference


def model_steps(
    folder: Path,
    kv_dtype: torch.dtype,
    prompts: list[list[int]],
    steps: int,
    greedy: bool,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Our model's float32 logits [prompts, vocab] on the torch backend over a pool of
    `kv_dtype` (with the checkpoint's KV scales, as the runner takes them): at the
    prompts' last tokens after one extend pass over them all, then after each of `steps`
    decode passes, fed the argmax (`greedy`) or fixed tokens."""
    model, c = load_model(folder, dtype, device)
    pool = KVPool(2048, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kv_dtype, device)
    if pool.quantized:
        pool.set_scales(checkpoint_kv_scales(folder, c.num_hidden_layers))
    requests = PagedRequests(pool, ReqToTokenPool(len(prompts) + 1, 1024, device))
    rows = [requests.new_request() for _ in prompts]
    backend = TorchAttentionBackend()
    batch = requests.build(ForwardMode.EXTEND, list(zip(rows, prompts, strict=True)))
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        for step in range(steps + 1):
            if step:
                fed = out[-1].argmax(-1).tolist() if greedy else [100 + 37 * step] * len(rows)
                batch = requests.build(
                    ForwardMode.DECODE, [(row, [t]) for row, t in zip(rows, fed, strict=True)]
                )
            backend.init_forward_metadata(batch)
            out.append(model(batch, backend).float())
    return out


def fp8_kv_greedy(
    folder: Path,
    prompts: list[list[int]],
    max_new: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[Reference]:
    """Greedy decoding over an FP8 pool (one extend pass, then decode passes), each
    step's top-2 gap beside its token."""
    logits = model_steps(folder, FP8_DTYPE, prompts, max_new - 1, True, device, dtype)
    refs = []
    for i in range(len(prompts)):
        rows = torch.stack([step[i] for step in logits]).cpu()
        top2 = rows.topk(2, dim=-1).values
        refs.append(Reference(rows.argmax(-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return refs
