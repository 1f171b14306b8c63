"""Where a frontend program's generations run: a radixserve server over HTTP (its native
`/generate`) or an in-process `Engine`. Both give the program the model's chat template
(the tokenizer's), which renders its chat turns, and score continuations (`select`) by
their prompt logprobs, tokenized here as the prefix's continuation."""

from __future__ import annotations

from dataclasses import dataclass
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

    def score(self, prefix: str, continuations: list[str]) -> list[float]:
        """Each continuation's mean token logprob after `prefix`."""
        ...

    def chat_template(self) -> ChatTemplate: ...


@dataclass(frozen=True)
class ScoreInputs:
    """What scoring continuations asks of a server: each `prefix + continuation` as token
    ids, and the position of its first token past the prefix's (where the two
    tokenizations part: a merge across the boundary scores the merged token)."""

    ids: list[list[int]]
    starts: list[int]

    @classmethod
    def of(
        cls, tokenizer: PreTrainedTokenizerBase, prefix: str, continuations: list[str]
    ) -> ScoreInputs:
        base = tokenizer.encode(prefix)
        ids, starts = [], []
        for text in continuations:
            full = tokenizer.encode(prefix + text)
            common = 0
            for a, b in zip(base, full, strict=False):
                if a != b:
                    break
                common += 1
            ids.append(full)
            starts.append(max(common, 1))  # the first token has no logprob
        return cls(ids, starts)

    @property
    def start(self) -> int:
        """One logprob_start_len for the batch: the earliest start."""
        return min(self.starts)

    def params(self) -> dict[str, Any]:
        return {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": self.start}

    def means(self, scored: list[list[float | None]]) -> list[float]:
        """Each continuation's mean logprob, from prompt logprobs that begin at `start`."""
        out = []
        for begin, values in zip(self.starts, scored, strict=True):
            mine = [v for v in values[begin - self.start :] if v is not None]
            out.append(sum(mine) / len(mine) if mine else float("-inf"))
        return out


class EngineBackend:
    """An in-process `radixserve.Engine` (thread-safe: `run_batch` shares it)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._template: ChatTemplate | None = None

    def generate(self, prompt: str, params: dict[str, Any]) -> str:
        out = self.engine.generate(prompt=prompt, sampling_params=params)
        assert isinstance(out, dict)
        return str(out["text"])

    def score(self, prefix: str, continuations: list[str]) -> list[float]:
        inputs = ScoreInputs.of(self.engine.tokenizer, prefix, continuations)
        outs = self.engine.generate(input_ids=inputs.ids, sampling_params=inputs.params())
        assert isinstance(outs, list)
        return inputs.means(
            [[lp for lp, _ in out["meta_info"]["input_token_logprobs"]] for out in outs]
        )

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate(self.engine.tokenizer)
        return self._template


class RuntimeEndpoint:
    """A radixserve server (`radixserve up`, the gateway's URL). The chat template and
    the tokenizer `select` scores with come from the served model's tokenizer, read here
    from `model_path` (a Hugging Face folder or a .gguf; None: the embedded SmolLM2,
    what `radixserve up` serves by default)."""

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
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._template: ChatTemplate | None = None

    def generate(self, prompt: str, params: dict[str, Any]) -> str:
        body = self._post({"text": prompt, "sampling_params": params})
        return str(body["text"])

    def score(self, prefix: str, continuations: list[str]) -> list[float]:
        inputs = ScoreInputs.of(self._load_tokenizer(), prefix, continuations)
        params = inputs.params()
        sampling = {"max_new_tokens": params.pop("max_new_tokens")}
        body = self._post({"input_ids": inputs.ids, "sampling_params": sampling, **params})
        return inputs.means(
            [[lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]] for out in body]
        )

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate(self._load_tokenizer())
        return self._template

    def close(self) -> None:
        self._client.close()

    def _post(self, body: dict[str, Any]) -> Any:
        try:
            response = self._client.post("/generate", json=body)
        except httpx.HTTPError as exc:
            raise LangError(f"{self._client.base_url}: {exc}") from exc
        if response.status_code != 200:
            raise LangError(f"/generate answered {response.status_code}: {_message(response)}")
        return response.json()

    def _load_tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            from radixserve.model_files.paths import resolve_model_path
            from radixserve.model_files.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(resolve_model_path(self._model_path))
        return self._tokenizer


def _message(response: httpx.Response) -> str:
    """The OpenAI-style error body's message, else the body itself."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
