"""Throwaway: decode step time of a SmolLM2-shaped random model with the torch backend."""
import sys, time, tempfile
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from radixserve.engine.model.loader import load_model
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.forward_batch import ForwardMode
from tests.helpers.batches import PagedRequests
dev = sys.argv[1]; dtype = getattr(torch, sys.argv[2])
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=1e5)
d = Path(tempfile.mkdtemp()); LlamaForCausalLM(cfg).save_pretrained(d)
model, c = load_model(d, dtype, dev)
kv = KVPool(32*420, 30, 3, 64, dtype, dev); reqs = PagedRequests(kv, ReqToTokenPool(40, 1024, dev)); be = TorchAttentionBackend()
rows = [reqs.new_request() for _ in range(32)]
def sync():
    if dev == "cuda": torch.cuda.synchronize()
with torch.inference_mode():
    t = time.perf_counter()
    b = reqs.build(ForwardMode.EXTEND, [(r, [5] * (380 + i % 8)) for i, r in enumerate(rows)])
    be.init_forward_metadata(b); model(b, be); sync()
    print(f"prefill 32 x ~384 tokens: {(time.perf_counter()-t)*1000:.1f} ms")
    ts = []
    for _ in range(10):
        b = reqs.build(ForwardMode.DECODE, [(r, [5]) for r in rows]); sync()
        t = time.perf_counter(); be.init_forward_metadata(b); model(b, be); sync(); ts.append(time.perf_counter() - t)
    print(f"{dev} {dtype} decode step bs=32 kv~384: min {min(ts)*1000:.1f} ms median {sorted(ts)[5]*1000:.1f} ms")
