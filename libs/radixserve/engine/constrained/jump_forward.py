"""Jump-forward: append what the grammar forces, without a forward pass per token.

After a constrained request samples its token, its matcher may admit a single
continuation (a JSON key and its `": "`, a closing `"}`). Those tokens are appended
to the output and accepted by the matcher now; the scheduler then sends the request
back through prefill, where one extend computes their KV (its computed prefix comes
from the radix cache) instead of one decode step each. Each forced token goes
through the same stop checks as a sampled one (length, stop strings, context).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.engine.sched.finish import Detokenize, check_finished

if TYPE_CHECKING:
    from radixserve.engine.request import FinishReason, Req


def jump_forward(
    req: Req, context_len: int, detokenize: Detokenize | None
) -> tuple[list[int], FinishReason | None]:
    """The tokens appended to `req.output_ids`, and the finish reason one of them hit."""
    state = req.grammar
    if state is None or req.finished:
        return [], None
    appended: list[int] = []
    for token in state.forced_tokens()[: req.remaining_new_tokens]:
        if not state.accept(token):  # cannot happen for a string the grammar forces; be safe
            break
        req.output_ids.append(token)
        appended.append(token)
        reason = check_finished(req, context_len, detokenize)
        if reason is not None:
            return appended, reason
    return appended, None
