"""Shared helpers for engine tests: prompts and the Hugging Face greedy reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve import Engine

# Top-2 logits closer than this may legitimately swap between two correct implementations.
TIE_TOLERANCE = 1e-4


def make_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the low ids: the SmolLM2 vocabulary keeps its special tokens there.
    return [torch.randint(100, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@dataclass
class Reference:
    tokens: list[int]
    top2_gaps: list[float]  # per generated position: logit[top1] - logit[top2]


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    device: str = "cpu",
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    attn_implementation: str | None = None,
) -> list[Reference]:
    """transformers' own generate, one prompt at a time (no padding), float32, with
    min_new_tokens so both sides run the full length without stopping on EOS. The top-2
    gaps are of the scores greedy chose from (after the penalty, the bias and the EOS
    mask)."""
    from transformers import AutoModelForCausalLM

    # attn_implementation None: transformers' default (SDPA where the model allows it).
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra)
    model = model.to(device).eval()
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                repetition_penalty=repetition_penalty,
                # OpenAI's logit_bias is transformers' bias of one-token sequences.
                sequence_bias=[[[t], b] for t, b in logit_bias.items()] if logit_bias else None,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            gaps = []
            for step_scores in out.scores:
                top2 = torch.topk(step_scores[0].float(), 2).values
                gaps.append(float(top2[0] - top2[1]))
            refs.append(Reference(out.sequences[0, len(ids) :].tolist(), gaps))
    return refs


def assert_matches_reference(
    ours: list[int], ref: Reference, tolerance: float = TIE_TOLERANCE
) -> None:
    """Token for token; a divergence is accepted only at a near-tie of the reference
    (a top-2 gap below `tolerance`)."""
    assert len(ours) == len(ref.tokens), (len(ours), len(ref.tokens))
    for pos, (a, b) in enumerate(zip(ours, ref.tokens, strict=True)):
        if a != b:
            assert ref.top2_gaps[pos] < tolerance, (
                f"token {pos}: ours {a} != reference {b} and the reference's top-2 gap "
                f"{ref.top2_gaps[pos]:.3g} is not a tie"
            )
            return  # past a tie the two sequences legitimately differ


def greedy_params(max_new_tokens: int) -> dict[str, object]:
    return {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "temperature": 0.0}


def engine_outputs(
    engine: Engine, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=greedy_params(max_new_tokens))
    assert isinstance(outs, list)
    return [o["output_ids"] for o in outs]


def hf_log_softmax(model_dir: str | Path) -> Callable[[list[int]], torch.Tensor]:
    """Hugging Face's float32 log-softmax over a prompt's logits, [len, vocab] (row i
    scores the token after position i), on the CPU: the reference for logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax
