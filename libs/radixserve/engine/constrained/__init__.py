"""Constrained decoding: a grammar matcher per request, a token bitmask per step.

- `backend.GrammarBackend`: compiles (or loads the grammar service's artifact of) a
  grammar for this model's tokenizer and vocabulary; makes each request's state.
- `state.GrammarState`: one request's matcher (what it may emit next, what it took).
- `logits.sample_with_grammar`: fills the bitmask of the constrained rows of a batch,
  applies it to the logits on their device with xgrammar's kernels, then samples.
- `jump_forward.jump_forward`: appends the continuation the grammar forces.

Importing this package does not import xgrammar; the first constrained request does.
"""

from __future__ import annotations

from radixserve.engine.constrained.backend import GrammarBackend
from radixserve.engine.constrained.jump_forward import jump_forward
from radixserve.engine.constrained.logits import sample_with_grammar
from radixserve.engine.constrained.state import GrammarState

__all__ = ["GrammarBackend", "GrammarState", "jump_forward", "sample_with_grammar"]
