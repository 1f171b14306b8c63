"""The model runner: owns the device, the weights, the KV memory and the attention backend.

Knows nothing about scheduling; one `forward` per step.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from radixserve.engine.attention.base import AttentionBackend
from radixserve.engine.config import EngineConfig
from radixserve.engine.forward_batch import ForwardBatch
from radixserve.engine.graphs.cuda_graph_runner import CudaGraphRunner
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.model.config import ModelConfig
from radixserve.engine.model.loader import load_model, resolve_dtype, resolve_model_path

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def make_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """The backend called `name` (one EngineConfig admits) for `device` and a model of
    `dtype` (None: not known).

    "auto": on CUDA flashinfer when it is installed and the model is float16 or
    bfloat16, else triton when it is installed (CUDA builds of torch bring it); the
    torch reference elsewhere (on the CPU triton runs only under its interpreter).
    Backends are imported only when chosen: they import packages CPU installs lack.
    """
    if name == "auto":
        name = _auto_backend(device, dtype)
    if name == "flashinfer":
        from radixserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device, dtype)
    if name == "triton":
        from radixserve.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    assert name == "torch", name
    from radixserve.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _auto_backend(device: torch.device, dtype: torch.dtype | None) -> str:
    if device.type != "cuda":
        return "torch"
    half = dtype in (torch.float16, torch.bfloat16)
    if half and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.model_path = resolve_model_path(config.model_path)
        model_config = ModelConfig.from_pretrained(self.model_path)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        trained_len = model_config.max_position_embeddings
        self.context_len = config.context_length or trained_len
        if self.context_len > trained_len:
            # The rotary table is sized for the configured context below; quality past
            # the trained length is the model's (and its rope scaling's) business.
            log.warning(
                "context_length %d exceeds the model's max_position_embeddings %d: the model "
                "was trained on shorter sequences and may degrade past them",
                self.context_len,
                trained_len,
            )
        self.model, self.model_config = load_model(
            self.model_path,
            self.dtype,
            self.device,
            max_positions=max(self.context_len, trained_len),
            config=model_config,
            load_format=config.load_format,
        )
        self.vocab_size = self.model_config.vocab_size
        self.kv_pool = KVPool(
            num_slots=self._kv_budget_tokens(),
            num_layers=self.model_config.num_hidden_layers,
            num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.dtype,
            device=self.device,
            page_size=config.page_size,
            debug=config.debug_check_invariants,
        )
        # One spare row: the request mid-chunk holds one beyond the running limit.
        self.req_pool = ReqToTokenPool(
            config.max_running_requests + 1, self.context_len, self.device
        )
        self.attn = make_attention_backend(config.attention_backend, self.device, self.dtype)
        log.info(
            "model %s on %s (%s), KV pool %d tokens",
            self.model_path,
            self.device,
            self.dtype,
            self.kv_pool.size,
        )
        self.graphs = self._capture_graphs()

    def _capture_graphs(self) -> CudaGraphRunner | None:
        """Decode graphs, on CUDA with a backend that supports them, unless disabled."""
        if self.config.disable_cuda_graph or self.device.type != "cuda":
            return None
        if not self.attn.supports_cuda_graph:
            log.info("the %s attention backend runs without CUDA graphs", self.attn.name)
            return None
        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        return CudaGraphRunner(self.model, self.attn, self.kv_pool, self.req_pool, max_bs)

    def _kv_budget_tokens(self) -> int:
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        if self.device.type != "cuda":
            return self.config.cpu_kv_tokens
        free, total = torch.cuda.mem_get_info(self.device)
        # What the static fraction leaves after the weights; the rest is for activations.
        budget = free - total * (1.0 - self.config.mem_fraction_static)
        c = self.model_config
        per_token = KVPool.bytes_per_token_for(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype
        )
        tokens = int(budget // per_token)
        if tokens < 16:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (free {free / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB); raise mem_fraction_static or use a smaller model"
            )
        # No ceiling: the free list lives on the device (8 bytes a page), so even a small
        # model's tens of millions of slots cost the host nothing.
        return tokens

    def close(self) -> None:
        """Drop the weights, the KV memory and the backend; free cached CUDA memory."""
        for name in ("graphs", "model", "kv_pool", "req_pool", "attn"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [batch_size, vocab]; a decode batch that fits a captured graph
        replays it (the logits are then valid until the next forward)."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.replay(batch)
        self.attn.init_forward_metadata(batch)
        return self.model(batch, self.attn)
