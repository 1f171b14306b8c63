"""Throwaway: model parity vs transformers on CUDA (tiny random models, small vocab)."""
import sys, time, tempfile
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, AutoModelForCausalLM
from radixserve.engine.model.loader import load_model
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.forward_batch import ForwardMode
from tests.helpers.batches import PagedRequests

print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, vocab_size=512, rms_norm_eps=1e-5)
root = Path(tempfile.mkdtemp())
def build(cls, cfg, name):
    torch.manual_seed(0); m = cls(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.2*torch.randn_like(p) if n.endswith("norm.weight") else torch.randn_like(p) / p.shape[-1]**0.5)
    m.save_pretrained(root / name); return root / name
dirs = {
 "llama3rope": build(LlamaForCausalLM, LlamaConfig(**shape, tie_word_embeddings=False, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), "a"),
 "qwen3": build(Qwen3ForCausalLM, Qwen3Config(**shape, tie_word_embeddings=True, attention_bias=True), "b"),
 "qwen2": build(Qwen2ForCausalLM, Qwen2Config(**shape, tie_word_embeddings=True), "c"),
}
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"; fails = 0
for name, d in dirs.items():
  for dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 0.25)):
    model, c = load_model(d, dtype, dev)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev).eval()
    kv = KVPool(1024, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype, dev)
    reqs = PagedRequests(kv, ReqToTokenPool(8, 256, dev)); be = TorchAttentionBackend()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (2, 9, 24, 41)]
    rows = [reqs.new_request() for _ in seqs]; halves = [len(s)//2 for s in seqs]
    follow = [7, 8, 9, 10]
    with torch.inference_mode():
        full = [ref(torch.tensor([s + [t]], device=dev)).logits[0].float() for s, t in zip(seqs, follow)]
        worst = 0.0
        for mode, parts, idx in (
            (ForwardMode.EXTEND, [(r, s[:h]) for r, s, h in zip(rows, seqs, halves)], [h-1 for h in halves]),
            (ForwardMode.EXTEND, [(r, s[h:]) for r, s, h in zip(rows, seqs, halves)], [len(s)-1 for s in seqs]),
            (ForwardMode.DECODE, [(r, [t]) for r, t in zip(rows, follow)], [len(s) for s in seqs]),
        ):
            b = reqs.build(mode, parts); be.init_forward_metadata(b); out = model(b, be)
            want = torch.stack([f[i] for f, i in zip(full, idx)])
            worst = max(worst, (out - want).abs().max().item())
    ok = worst <= atol; fails += not ok
    print(f"{name:10s} {str(dtype):15s} max|diff| {worst:.2e} (atol {atol}) {'OK' if ok else 'FAIL'}")
sys.exit(1 if fails else 0)
