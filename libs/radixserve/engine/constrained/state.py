"""`GrammarState`: one request's grammar matcher.

Each request (each of the `n` choices) has its own matcher over a shared, immutable
compiled grammar, so requests that share a prompt (the radix cache) or a grammar
never share matcher state. The matcher has accepted exactly the request's output
tokens; a retracted request keeps it and goes on where it stopped, a resumed one
replays the tokens another worker generated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


class GrammarState:
    def __init__(
        self,
        matcher: xgr.GrammarMatcher,
        encode: Encode,
        decode: Decode,
        jump_forward: bool,
    ) -> None:
        self.matcher = matcher
        self._encode = encode
        self._decode = decode
        # Off for requests that return logprobs: forced tokens have no forward pass,
        # so they would have no logprob to report.
        self.jump_forward = jump_forward

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the batch bitmask: 1 bits for the tokens the grammar admits next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance on `token`; False (state unchanged) when the grammar does not admit it."""
        return bool(self.matcher.accept_token(token))

    def replay(self, tokens: list[int]) -> None:
        """Advance through output tokens generated elsewhere (a resumed request);
        ValueError naming the first one the grammar does not admit."""
        for position, token in enumerate(tokens):
            if not self.accept(token):
                raise ValueError(
                    f"resume_ids[{position}] (token {token}) is not accepted by the "
                    "request's grammar"
                )

    def forced_tokens(self) -> list[int]:
        """Tokens of the continuation the grammar admits alone (xgrammar's jump-forward
        string), not accepted yet.

        The string is tokenized on its own and its last token is left out: the model
        samples the boundary between the forced text and what follows it (a token
        that spans both is its choice), so the output keeps the tokenization it
        would have produced. Tokens already emitted are never rewritten (they may
        have been streamed). Empty when nothing is forced or the tokenizer does not
        round-trip the string (e.g. a SentencePiece prefix space).
        """
        if not self.jump_forward or self.terminated:
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        tokens = self._encode(text)
        if len(tokens) < 2 or self._decode(tokens) != text:
            return []
        return tokens[:-1]
