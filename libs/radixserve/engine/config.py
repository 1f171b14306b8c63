"""The engine's one typed configuration object; keyword names are the worker's flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
# "auto" picks the fastest one the device and dtype run (runner.make_attention_backend).
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer", "auto")
# The model's dtype, or e4m3 codes (kvcache/fp8.py).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
HICACHE_WRITE_POLICIES = ("write_back", "write_through")


@dataclass
class EngineConfig:
    # Model: None means the embedded SmolLM2-135M-Instruct GGUF.
    model_path: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto (the checkpoint) | dummy (random weights: benchmarks)
    # fp8: a 16-bit checkpoint's projections quantized to FP8 on load (per output row;
    # activations per token). None: as the checkpoint is (an FP8 one is read as FP8).
    quantization: str | None = None
    # A GGUF model: "quantized" keeps its projections' blocks (model_files/gguf_quantized.py),
    # "dequantized" converts it to float32. None: quantized on CUDA, dequantized on the CPU
    # (where dequantizing every call is slower than reading float32 weights).
    gguf_weights: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto: on CUDA FlashInfer's prefill with Triton's decode for float16/bfloat16 when
    # flashinfer is installed, else triton; torch on the CPU. flashinfer and triton run
    # decode in CUDA graphs.
    attention_backend: str = "auto"
    # Either pass kind on another backend (torch, triton or flashinfer); None: as chosen
    # by attention_backend. Decode passes are those where every request adds one token.
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    # KV memory. On a GPU the pool takes what mem_fraction_static leaves after the
    # weights; on the CPU it holds cpu_kv_tokens. max_total_tokens overrides both.
    mem_fraction_static: float = 0.85
    cpu_kv_tokens: int = 32768
    max_total_tokens: int | None = None
    page_size: int = 1
    # What the KV pool stores: auto (the model's dtype) or fp8_e4m3 (e4m3 codes with a
    # K and a V scale per layer, from the checkpoint or 1.0: half the bytes a token,
    # so twice the tokens in the same memory; kvcache/fp8.py).
    kv_cache_dtype: str = "auto"
    # None (the default): by the device (runner.batch_limit): 512 on a GPU of 70 GiB or
    # more, else 256; resolved when the model runner starts.
    max_running_requests: int | None = None
    context_length: int | None = None  # default: the model's max_position_embeddings
    # CUDA graphs for decode batches (CUDA and a backend that supports them only): captured
    # at start-up for batch sizes up to cuda_graph_max_bs (capped by max_running_requests;
    # None: by the device, as max_running_requests).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # Prefill and mixed passes of up to this many tokens run as CUDA graphs too, piece
    # by piece between the (eager) attention calls (graphs/piecewise.py): such passes
    # are bound by the host's launches. 0: eager. Off with disable_cuda_graph.
    piecewise_cuda_graph_max_tokens: int = 512
    # Overlap scheduling (CUDA only; the CPU has nothing to overlap): the host plans and
    # launches step N+1 while the device runs step N, reading step N's tokens one step late.
    disable_overlap_schedule: bool = False
    # Cascade attention (triton and flashinfer backends): decode requests that share a
    # cached prefix read it once per step for the whole group (attention/cascade.py).
    disable_cascade_attention: bool = False
    # FlashInfer's SM90 prefill kernels on Hopper GPUs (flashinfer backend): prefill passes
    # that long prompts dominate run them, ~1.6x faster than FA2 there. Opt-in: they are
    # JIT-compiled in the background at start-up (about 90 s of nvcc the first time, cached
    # under FlashInfer's workspace after); FA2 meanwhile.
    enable_sm90_prefill: bool = False
    # Tensor parallelism: one process per rank (this one is rank 0), each with a shard of
    # the projections and KV heads, on CUDA one GPU each (NCCL), gloo on the CPU.
    tp_size: int = 1
    # A collective between the ranks that waits this long fails (a rank is stuck). Ranks
    # waiting for rank 0's next step have no timeout (an idle engine), and a rank whose
    # process exits is seen at once.
    dist_timeout_s: float = 600.0
    # Scheduling.
    schedule_policy: str = "lpm"
    chunked_prefill_size: int = 2048  # <= 0: no chunking
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = True  # decode requests ride along with prefill batches
    disable_radix_cache: bool = False
    # HiCache: a host-memory KV pool of this many GiB under the radix tree (pinned on
    # CUDA); prefixes evicted from the device stay there and are loaded back on a match
    # (kvcache/hiradix_cache.py). 0: off. write_back copies a prefix to the host when the
    # device evicts it, write_through when it is cached.
    hicache_size_gb: float = 0.0
    hicache_write_policy: str = "write_back"
    # HiCache's shared tier: a directory (a volume several workers mount) of KV blocks
    # keyed by the KV events' block hashes, so a worker loads prefixes another computed
    # (kvcache/block_store.py). Written with the host tier's copies. None: off.
    hicache_storage_dir: str | None = None
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    random_seed: int = 0
    # Batches with more waiting requests than this skip the lpm sort (it costs a tree walk each).
    lpm_max_waiting: int = 128
    # Request priorities (higher admitted first; schedule_policy orders within a level): a
    # request waiting longer than this is admitted as if of the highest priority, so a
    # steady stream of high-priority requests cannot hold a low one back for ever.
    # 0: no bound (strict priorities).
    priority_starvation_s: float = 10.0
    # Once started, the engine freezes the objects alive then out of the cyclic
    # collector's reach and raises its young-generation threshold (engine/heap.py): a
    # full collection would walk them all, pausing the host (and the GPU) ~0.3 s on an
    # 8B model. This leaves the collector as the process had it.
    disable_gc_freeze: bool = False
    # Tests: check the KV accounting invariant after every step (costs a tree walk).
    debug_check_invariants: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        for name in ("prefill_attention_backend", "decode_attention_backend"):
            value = getattr(self, name)
            if value is not None and value not in ATTENTION_BACKENDS[:-1]:
                raise ValueError(f"{name} must be one of {ATTENTION_BACKENDS[:-1]}, got {value!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 (or unset), got {self.quantization!r}")
        if self.gguf_weights not in (None, "quantized", "dequantized"):
            raise ValueError(
                f"gguf_weights must be quantized or dequantized (or unset), got {self.gguf_weights!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        for name in (
            "max_running_requests",
            "max_prefill_tokens",
            "cpu_kv_tokens",
            "cuda_graph_max_bs",
            "tp_size",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.priority_starvation_s >= 0:  # NaN too
            raise ValueError(
                f"priority_starvation_s must be >= 0 (0: no bound), got {self.priority_starvation_s}"
            )
        if not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        if self.piecewise_cuda_graph_max_tokens < 0:
            raise ValueError("piecewise_cuda_graph_max_tokens must be >= 0 (0: off)")
        if not self.hicache_size_gb >= 0:
            raise ValueError(f"hicache_size_gb must be >= 0 (0: off), got {self.hicache_size_gb}")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, "
                f"got {self.hicache_write_policy!r}"
            )
        if self.hicache_storage_dir and not self.hicache_size_gb:
            raise ValueError("hicache_storage_dir needs the host tier: set hicache_size_gb too")
        if self.hicache_size_gb and self.disable_radix_cache:
            raise ValueError("hicache_size_gb needs the radix cache (drop disable_radix_cache)")
        if self.hicache_size_gb and self.tp_size > 1:
            raise ValueError("hicache_size_gb does not work with tp_size > 1 yet")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError("max_total_tokens must be >= 2")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
