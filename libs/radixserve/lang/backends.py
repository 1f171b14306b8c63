"""Where a frontend program's generations run: a radixserve server over HTTP (its native
`/generate`) or an in-process `Engine`. Both give the program the model's chat template
(the tokenizer's), which renders its chat turns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import httpx

from radixserve.lang.primitives import LangError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from radixserve.engine.engine import Engine


class ChatTemplate:
    """The tokenizer's chat template, as text (the server tokenizes it again)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise LangError("the model's tokenizer has no chat template: use plain text")
        self._tokenizer = tokenizer

    def render(self, messages: list[dict[str, str]], generation: bool) -> str:
        """`messages` as the model sees them; `generation`: followed by the assistant's
        turn opening (where its answer starts)."""
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
        return str(text)


class Backend(Protocol):
    def generate(self, prompt: str, params: dict[str, Any]) -> str:
        """The text generated after `prompt` (SGLang sampling parameter names)."""
        ...

    def chat_template(self) -> ChatTemplate: ...


class EngineBackend:
    """An in-process `radixserve.Engine` (thread-safe: `run_batch` shares it)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._template: ChatTemplate | None = None

    def generate(self, prompt: str, params: dict[str, Any]) -> str:
        out = self.engine.generate(prompt=prompt, sampling_params=params)
        assert isinstance(out, dict)
        return str(out["text"])

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate(self.engine.tokenizer)
        return self._template


class RuntimeEndpoint:
    """A radixserve server (`radixserve up`, the gateway's URL). The chat template comes
    from the served model's tokenizer, read here from `model_path` (a Hugging Face
    folder or a .gguf; None: the embedded SmolLM2, what `radixserve up` serves by
    default)."""

    def __init__(
        self,
        base_url: str,
        *,
        model_path: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)
        self._model_path = model_path
        self._template: ChatTemplate | None = None

    def generate(self, prompt: str, params: dict[str, Any]) -> str:
        try:
            response = self._client.post(
                "/generate", json={"text": prompt, "sampling_params": params}
            )
        except httpx.HTTPError as exc:
            raise LangError(f"{self._client.base_url}: {exc}") from exc
        if response.status_code != 200:
            raise LangError(f"/generate answered {response.status_code}: {_message(response)}")
        return str(response.json()["text"])

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            from radixserve.engine.model.loader import resolve_model_path
            from radixserve.engine.model.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(resolve_model_path(self._model_path))
            self._template = ChatTemplate(tokenizer)
        return self._template

    def close(self) -> None:
        self._client.close()


def _message(response: httpx.Response) -> str:
    """The OpenAI-style error body's message, else the body itself."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
