"""Write a random-weight model with SmolLM2-135M's shapes (for a GPU that lacks the GGUF).

    python lab/probes/make_random_model.py OUT_DIR --tokenizer DIR_WITH_TOKENIZER_FILES

Speed depends on shapes, not on weight values, so throughput figures from this model
stand for SmolLM2-135M's; its outputs are meaningless.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out_dir")
    ap.add_argument("--tokenizer", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    config = LlamaConfig(
        **SMOLLM2_135M, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    print(args.out_dir)


if __name__ == "__main__":
    main()
