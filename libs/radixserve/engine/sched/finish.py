"""When a request is done: stop tokens, length limits, stop strings, a finished grammar."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.engine.request import FinishReason, Req

Detokenize = Callable[[list[int]], str]


def check_finished(
    req: Req, context_len: int, detokenize: Detokenize | None
) -> FinishReason | None:
    """Called after a token was appended to req.output_ids."""
    params = req.params
    last = req.output_ids[-1]
    num_out = len(req.output_ids)
    if last in req.stop_token_ids and num_out >= params.min_new_tokens:
        return FinishReason("stop", matched=last)
    if params.stop and detokenize is not None and num_out >= params.min_new_tokens:
        matched = _match_stop_string(req, detokenize)
        if matched is not None:
            return FinishReason("stop", matched=matched)
    return limit_reached(req, context_len)


def limit_reached(req: Req, context_len: int) -> FinishReason | None:
    """What ends a request whatever its last token: a complete grammar, max_new_tokens,
    the context. Alone for a resumed request's output so far: a stop token there
    (min_new_tokens may have kept it going) does not end it."""
    num_out = len(req.output_ids)
    if req.grammar is not None and req.grammar.terminated:
        # Structured outputs: the grammar is complete and admits nothing more (a request
        # without stop tokens ends here; with them, the stop token above ended it).
        return FinishReason("stop")
    if num_out >= req.params.max_new_tokens:
        return FinishReason("length")
    if len(req.origin_input_ids) + num_out >= context_len:  # the tokens read, not pending
        return FinishReason("length", message="reached the model's context length")
    return None


def _match_stop_string(req: Req, detokenize: Detokenize) -> str | None:
    # A stop string of n characters spans at most n tokens (every token decodes to at
    # least one character, or to a partial one); a few more absorb partial UTF-8.
    longest = max(len(s) for s in req.params.stop)
    tail = detokenize(req.output_ids[-(longest + 4) :])
    for stop in req.params.stop:
        if stop and stop in tail:
            return stop
    return None
