"""`PrepError`: why a request cannot go on, in the OpenAI error shape the gateway answers with."""

from __future__ import annotations

from radixserve.protocol import RequestError

# Codes of the errors table in docs/request-path.md that the tokenizer sends.
INVALID_REQUEST = "invalid_request_error"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
GRAMMAR_NOT_SUPPORTED = "grammar_not_supported"
GRAMMAR_UNAVAILABLE = "grammar_unavailable"
INVALID_GRAMMAR = "invalid_grammar"


class PrepError(ValueError):
    """A request failed preparation; `to_request_error` is what the gateway receives."""

    def __init__(
        self,
        message: str,
        *,
        code: str = INVALID_REQUEST,
        param: str | None = None,
        http_status: int = 400,
        error_type: str = "invalid_request_error",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.http_status = http_status
        self.error_type = error_type
        self.retry_after_s = retry_after_s

    def to_request_error(self, rid: str, service: str = "tokenizer") -> RequestError:
        return RequestError(
            rid=rid,
            code=self.code,
            message=self.message,
            http_status=self.http_status,
            error_type=self.error_type,
            param=self.param,
            service=service,
            retry_after_s=self.retry_after_s,
        )
