"""Our model and the Hugging Face reference side by side, over real KV pools."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.engine.attention.base import AttentionBackend
from radixserve.engine.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.forward_batch import ForwardBatch
from radixserve.engine.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.engine.model.loader import load_model
from tests.helpers.batches import PagedRequests


class ModelHarness:
    """Run `ForwardBatch`es through our model; get reference logits from transformers."""

    def __init__(
        self,
        folder: Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: AttentionBackend | None = None,
        kv_slots: int = 1024,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model, self.config = load_model(folder, dtype, device)
        self.reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        c = self.config
        kv_pool = KVPool(
            kv_slots, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype, device
        )
        self.requests = PagedRequests(kv_pool, ReqToTokenPool(8, 512, device))
        self.backend = backend or TorchAttentionBackend()

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Our float32 logits at each request's last new token, [batch_size, vocab]."""
        with torch.inference_mode():
            self.backend.init_forward_metadata(batch)
            return self.model(batch, self.backend)

    def reference_logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] float32 logits of the whole sequence in one transformers forward."""
        with torch.inference_mode():
            tokens = torch.tensor([ids], device=self.device)
            return self.reference(tokens).logits[0].float()
