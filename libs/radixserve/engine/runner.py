"""The model runner: owns the device, the weights, the KV memory and the attention backend.

Knows nothing about scheduling; one `forward` per step.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from radixserve.engine.attention.base import AttentionBackend, layer_attention
from radixserve.engine.attention.sm90_prefill import is_sm90
from radixserve.engine.blas import heuristics_cache_capacity, prefer_cublaslt, size_heuristics_cache
from radixserve.engine.config import EngineConfig
from radixserve.engine.constrained import logits as grammar_logits
from radixserve.engine.distributed import SINGLE, TPGroup, with_direct_nccl
from radixserve.engine.forward_batch import ForwardBatch, ForwardMode, SharedPrefix
from radixserve.engine.graphs.cuda_graph_runner import CudaGraphRunner
from radixserve.engine.graphs.piecewise import PiecewiseGraphs
from radixserve.engine.heap import collect_all
from radixserve.engine.kvcache.fp8 import kv_cache_dtype
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.model.kv_scales import checkpoint_kv_scales
from radixserve.engine.model.loader import load_model, resolve_dtype
from radixserve.engine.sampling import sampler
from radixserve.model_files.config import ModelConfig
from radixserve.model_files.paths import resolve_model_path

log = logging.getLogger(__name__)


# Batch limits by device (max_running_requests and cuda_graph_max_bs left at None in
# engine/config.py): on a large GPU more running requests pay only with graphs as large,
# so the two move together (measured: lab/notebook/2026-11-23-where-shared-prefix-run-time-goes.md).
LARGE_GPU_BYTES = 70 * 1024**3
LARGE_GPU_BATCH = 512
DEFAULT_BATCH = 256

# How a forward pass runs: a decode CUDA graph's replay, the prefill pieces' replays
# around eager attention, or eagerly.
FORWARD_PASS_KINDS = ("decode_graph", "prefill_pieces", "eager")


def batch_limit(device: torch.device) -> int:
    """The running-request limit (and largest decode graph) when the config leaves it unset."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if total >= LARGE_GPU_BYTES:
            return LARGE_GPU_BATCH
    return DEFAULT_BATCH


def resolve_batch_limits(config: EngineConfig, device: torch.device) -> tuple[int, int]:
    """(max_running_requests, cuda_graph_max_bs) for `device`, the unset ones by
    batch_limit; written back into `config`, so it shows what runs."""
    default = batch_limit(device)
    max_running = config.max_running_requests or default
    graph_max_bs = config.cuda_graph_max_bs or default
    config.max_running_requests, config.cuda_graph_max_bs = max_running, graph_max_bs
    return max_running, graph_max_bs


def resolve_device(name: str, tp_size: int = 1) -> torch.device:
    """The device `name` means here; with `tp_size` ranks on CUDA, also checks that the
    GPUs they take (tp_device) are visible."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index + tp_size > torch.cuda.device_count():
        raise ValueError(
            f"tp_size {tp_size} from {device} needs GPUs {device.index}.."
            f"{device.index + tp_size - 1}, but {torch.cuda.device_count()} are visible "
            "(CUDA_VISIBLE_DEVICES)"
        )
    return device


def tp_device(device: torch.device, tp: TPGroup) -> torch.device:
    """Rank r of a tensor-parallel engine on CUDA runs on the r-th GPU after `device`."""
    if tp.size == 1 or device.type != "cuda":
        return device
    device = torch.device("cuda", (device.index or 0) + tp.rank)
    torch.cuda.set_device(device)
    return device


def make_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    *,
    prefill: str | None = None,
    decode: str | None = None,
    sm90_prefill: bool = False,
    head_dim: int | None = None,
) -> AttentionBackend:
    """The attention backend for `device` and a model of `dtype` and `head_dim` (either
    None: not known): `name` (one EngineConfig admits) for every pass, or where
    `prefill` or `decode` names another backend for that kind of pass, a hybrid of the
    two (attention/hybrid.py).

    "auto": on CUDA, for a float16 or bfloat16 model with flashinfer installed,
    FlashInfer's prefill with Triton's decode (lab/notebook/2026-11-23-auto-flashinfer-prefill-triton-decode-kernel.md:
    Triton's decode keeps its tables in the graph, FlashInfer's prefill serves cached
    prefixes beside decoders best); else triton when it is installed (CUDA builds of
    torch bring it); the torch reference elsewhere (on the CPU triton runs only under
    its interpreter). FlashInfer's kernels are built for heads of FLASHINFER_HEAD_DIMS
    only: "auto" passes it over for other models, and naming it for one is an error.
    Backends are imported only when chosen: they import packages CPU installs lack.
    """
    prefill_name, decode_name = attention_backend_names(
        name, device, dtype, prefill, decode, head_dim
    )
    if "flashinfer" in (prefill_name, decode_name) and head_dim not in (
        None,
        *FLASHINFER_HEAD_DIMS,
    ):
        raise ValueError(
            f"the flashinfer attention backend runs heads of {FLASHINFER_HEAD_DIMS} "
            f"elements; this model's have {head_dim}: use --attention-backend triton"
        )
    if prefill_name == decode_name:
        return _backend(prefill_name, device, dtype, sm90_prefill)
    from radixserve.engine.attention.hybrid import HybridAttentionBackend

    return HybridAttentionBackend(
        _backend(prefill_name, device, dtype, sm90_prefill),
        _backend(decode_name, device, dtype, sm90_prefill),
    )


def sm90_prefill_applies(attn: AttentionBackend, device: torch.device) -> bool:
    """Whether `enable_sm90_prefill` can act: prefills on flashinfer, a Hopper GPU."""
    prefill = getattr(attn, "prefill", attn)  # a hybrid's prefill side
    return prefill.name == "flashinfer" and is_sm90(device)


def attention_backend_names(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    prefill: str | None = None,
    decode: str | None = None,
    head_dim: int | None = None,
) -> tuple[str, str]:
    """(prefill, decode) backend names that make_attention_backend builds."""
    chosen = _auto_backend(device, dtype, head_dim) if name == "auto" else name
    auto_decode = "triton" if name == "auto" and chosen == "flashinfer" else chosen
    return prefill or chosen, decode or auto_decode


def _backend(
    name: str, device: torch.device, dtype: torch.dtype | None, sm90_prefill: bool = False
) -> AttentionBackend:
    if name == "flashinfer":
        from radixserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(device, dtype, sm90_prefill)
    if name == "triton":
        from radixserve.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    assert name == "torch", name
    from radixserve.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


# The head sizes FlashInfer's prefill and decode kernels are built for: a tiny model's
# 16-element heads failed its prefill ("Invalid configuration", H100, 0.7.2.post1).
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def _auto_backend(device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> str:
    if device.type != "cuda":
        return "torch"
    half = dtype in (torch.float16, torch.bfloat16)
    heads_fit = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
    if half and heads_fit and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup = SINGLE) -> None:
        """`tp`: this process's rank of a tensor-parallel engine (it holds that shard of
        the model and of the KV heads, on the GPU of its rank)."""
        self.config = config
        self.device = tp_device(resolve_device(config.device), tp)
        self.tp = tp = with_direct_nccl(tp, self.device)
        self.max_running_requests, self.cuda_graph_max_bs = resolve_batch_limits(
            config, self.device
        )
        gguf_weights = config.gguf_weights or (
            "quantized" if self.device.type == "cuda" else "dequantized"
        )
        self.model_path = resolve_model_path(config.model_path, gguf_weights=gguf_weights)
        model_config = ModelConfig.from_pretrained(self.model_path)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        if self.device.type == "cuda":
            prefer_cublaslt()
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
            tp=tp,
            quantization=config.quantization,
        )
        self.vocab_size = self.model_config.vocab_size
        self.local_kv_heads = tp.split(self.model_config.num_key_value_heads, "KV heads")
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.kv_pool = KVPool(
            num_slots=self._kv_budget_tokens(),
            num_layers=self.model_config.num_hidden_layers,
            num_kv_heads=self.local_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
            page_size=config.page_size,
            debug=config.debug_check_invariants,
        )
        if self.kv_pool.quantized and config.load_format != "dummy":
            self.kv_pool.set_scales(
                checkpoint_kv_scales(self.model_path, self.model_config.num_hidden_layers)
            )
        sm90_prefill = config.enable_sm90_prefill
        if sm90_prefill and self.kv_pool.quantized:
            # Its kernels take FP8 K/V only beside FP8 queries.
            log.warning("enable_sm90_prefill is off with an FP8 KV cache: prefills run FA2")
            sm90_prefill = False
        # One spare row: the request mid-chunk holds one beyond the running limit.
        self.req_pool = ReqToTokenPool(self.max_running_requests + 1, self.context_len, self.device)
        self.attn = make_attention_backend(
            config.attention_backend,
            self.device,
            self.dtype,
            prefill=config.prefill_attention_backend,
            decode=config.decode_attention_backend,
            sm90_prefill=sm90_prefill,
            head_dim=self.model_config.head_dim,
        )
        self.attn.set_layers(layer_attention(self.model_config))
        if sm90_prefill and not sm90_prefill_applies(self.attn, self.device):
            log.warning(
                "enable_sm90_prefill has no effect here: it needs prefills on the flashinfer "
                "backend on a Hopper GPU (they run on %s, %s)",
                self.attn.name,
                torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            )
        log.info(
            "model %s on %s (%s), KV pool %d tokens (%s)",
            self.model_path,
            self.device,
            self.dtype,
            self.kv_pool.size,
            self.kv_dtype,
        )
        self.cascade = self.attn.supports_shared_prefix and not config.disable_cascade_attention
        # Forward passes so far by how they ran (the worker's forward_passes metric).
        self.forward_passes = dict.fromkeys(FORWARD_PASS_KINDS, 0)
        if self.device.type == "cuda":
            self._warm_up_prefill()
        # The prefill pieces, then the decode graphs, on one capture stream: any other
        # order, or a stream each, leaves the decode graphs' Triton kernels launching
        # plainly rather than as programmatic dependents (a gap before each; measured:
        # lab/notebook/2026-11-29-h200-capture-order-measured-flashinfer-side.md).
        self.piecewise: PiecewiseGraphs | None = None
        self.graphs: CudaGraphRunner | None = None
        if self._uses_cuda_graphs():
            stream = torch.cuda.Stream(self.device)
            self.piecewise = self._capture_piecewise(stream)
            self.graphs = self._capture_graphs(stream)
            # Idle from now on: a mixed step's side work runs there too, not on a new stream.
            self.attn.use_side_stream(stream)
        if self.device.type == "cuda":
            if self.cascade and not self._cascade_captured():
                self._warm_up_cascade()
            sampler.warm_up(self.vocab_size, self.dtype, self.device)
            grammar_logits.warm_up(self.vocab_size, self.device)
            c = self.model_config
            self.attn.start_kernel_builds(
                c.num_attention_heads // tp.size, self.local_kv_heads, c.head_dim, self.dtype
            )
            size_heuristics_cache(heuristics_cache_capacity(config, self.max_running_requests))

    def _uses_cuda_graphs(self) -> bool:
        """Whether decode graphs run: on CUDA with a backend that supports them, unless
        disabled."""
        if self.config.disable_cuda_graph or self.device.type != "cuda":
            return False
        if not self.attn.supports_cuda_graph:
            log.info("the %s attention backend runs without CUDA graphs", self.attn.name)
            return False
        return True

    def _capture_graphs(self, stream: torch.cuda.Stream) -> CudaGraphRunner:
        """Decode graphs, captured on `stream`."""
        max_bs = min(self.cuda_graph_max_bs, self.max_running_requests)
        return CudaGraphRunner(
            self.model,
            self.attn,
            self.kv_pool,
            self.req_pool,
            max_bs,
            cascade=self.cascade,
            stream=stream,
        )

    def _capture_piecewise(self, stream: torch.cuda.Stream) -> PiecewiseGraphs | None:
        """Prefill pieces, captured on `stream` where decode graphs run (after the prefill
        warm-up built the prefill kernels), unless their token limit is 0. Under tensor
        parallelism every rank captures the same pieces, their all-reduces included, as
        with the decode graphs."""
        max_tokens = self.config.piecewise_cuda_graph_max_tokens
        if max_tokens == 0:
            return None
        return PiecewiseGraphs(self.model, self.attn, self.kv_pool, max_tokens, stream)

    def _cascade_captured(self) -> bool:
        """Whether graph capture already compiled the cascade kernels."""
        return self.graphs is not None and bool(self.graphs.cascade_sizes)

    def uses_cascade(self, batch_size: int, mixed: bool = False) -> bool:
        """Whether a step of `batch_size` requests runs cascade attention for its decoding
        requests that share prefixes: a decode step where its graph size has a cascade
        variant or where it runs eagerly anyway (beyond the largest graph, or without
        graphs); a `mixed` step (prefills beside decodes) always, being eager. Not a
        decode step of the small sizes whose graphs have no cascade variant: it would
        run eagerly, and the host's eager launches cost more than the KV reads cascade
        saves (measured: lab/notebook/2026-11-22-cascade-cuda-graphs-mixed-batches-pass.md)."""
        if not self.cascade:
            return False
        graphs = self.graphs
        return (
            mixed or graphs is None or batch_size > graphs.max_bs or graphs.runs_cascade(batch_size)
        )

    @torch.inference_mode()
    def _warm_up_prefill(self, tokens: int = 16) -> None:
        """Build the prefill kernels now rather than in the first request: FlashInfer
        JIT-compiles its prefill module at its first plan (~20 s on a fresh machine,
        measured as a stall of the first request behind a worker that said it was ready)
        and Triton its extend kernels at their first launch. One pass of `tokens` new
        tokens of one request on the request pool's padding row: they read and write the
        reserved slot 0 only."""
        if self.context_len <= tokens:
            return
        row = self.req_pool.padding_row
        ints = self._ints
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=self.device),
            positions=torch.arange(tokens, dtype=torch.int64, device=self.device),
            out_cache_loc=torch.zeros(tokens, dtype=torch.int64, device=self.device),
            req_pool_indices=ints(row),
            seq_lens=ints(tokens),
            extend_prefix_lens=ints(0),
            extend_seq_lens=ints(tokens),
            extend_start_loc=ints(0),
            req_to_token=self.req_pool.req_to_token,
            kv_pool=self.kv_pool,
            seq_lens_cpu=[tokens],
            extend_prefix_lens_cpu=[0],
            extend_seq_lens_cpu=[tokens],
        )
        self.attn.init_forward_metadata(batch)
        self.model(batch, self.attn)

    @torch.inference_mode()
    def _warm_up_cascade(self, prefix: int = 64) -> None:
        """Compile the cascade kernels now rather than at the first shared-prefix step (a
        stall of seconds), where no graph capture did: one pass of two requests sharing a
        prefix, both on the request pool's padding row, so they read and write the
        reserved slot 0 only."""
        if self.context_len <= prefix:
            return
        row = self.req_pool.padding_row
        ints = self._ints
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=ints(0, 0),
            positions=ints(prefix, prefix),
            out_cache_loc=ints(0, 0),
            req_pool_indices=ints(row, row),
            seq_lens=ints(prefix + 1, prefix + 1),
            extend_prefix_lens=ints(prefix, prefix),
            extend_seq_lens=ints(1, 1),
            extend_start_loc=ints(0, 1),
            req_to_token=self.req_pool.req_to_token,
            kv_pool=self.kv_pool,
            seq_lens_cpu=[prefix + 1] * 2,
            extend_prefix_lens_cpu=[prefix] * 2,
            extend_seq_lens_cpu=[1, 1],
            shared_prefixes=(SharedPrefix(prefix, (0, 1)),),
        )
        self.attn.init_forward_metadata(batch)
        self.model(batch, self.attn)

    def _ints(self, *values: int) -> torch.Tensor:
        """An int64 tensor of `values` on the device (the warm-up passes' batches)."""
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _kv_budget_tokens(self) -> int:
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        if self.device.type != "cuda":
            return self.config.cpu_kv_tokens
        # Every rank must hold the same pool (their schedulers decide alike): the least.
        return self.tp.min_int(self._gpu_kv_budget_tokens())

    def _gpu_kv_budget_tokens(self) -> int:
        # What an engine of this process left behind is free for this one: memory in
        # torch's cache, or held by objects only a cycle collection frees (an engine
        # dropped without shutdown(), frozen with it). mem_get_info counts either as taken.
        collect_all()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # What the static fraction leaves after the weights; the rest is for activations.
        budget = free - total * (1.0 - self.config.mem_fraction_static)
        c = self.model_config
        per_token = KVPool.bytes_per_token_for(
            c.num_hidden_layers, self.local_kv_heads, c.head_dim, self.kv_dtype
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
        self._close_graphs()
        for name in ("model", "kv_pool", "req_pool", "attn"):
            self.__dict__.pop(name, None)
        # The communicators close after this, with the group (distributed.destroy_tp_group).
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _close_graphs(self) -> None:
        """Destroy the CUDA graphs, even if a caller holds them. A function of its own: a
        local left holding them (and, through them, the KV pool) until close() emptied
        the cache kept the pool's memory in torch's cache after shutdown."""
        for name in ("graphs", "piecewise"):
            holder = self.__dict__.pop(name, None)
            if holder is not None:
                holder.close()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch_size, vocab] in the model's dtype; a decode batch that fits a
        captured graph replays it (the logits are then valid until the next forward)."""
        if self.graphs is not None and batch.logprob_rows is None and self.graphs.can_run(batch):
            self.forward_passes["decode_graph"] += 1
            return self.graphs.replay(batch)
        if self.piecewise is not None and self.piecewise.can_run(batch):
            self.forward_passes["prefill_pieces"] += 1
            return self.piecewise.run(batch)
        self.forward_passes["eager"] += 1
        self.attn.init_forward_metadata(batch)
        return self.model(batch, self.attn)
