"""The served model's tokenizer and its chat template, from local files only.

transformers 5's AutoTokenizer imports torch (its config classes do): about 240 MB and
seconds of start-up for a CPU service that only tokenizes. Where AutoTokenizer would
pick the generic tokenizers backend anyway (`_loads_as_generic_backend`), the backend
is loaded directly, without torch; every other folder goes through AutoTokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase, TokenizersBackend

# The files that define a tokenizer's behaviour, hashed into its id. Anything else in
# the model folder (weights, generation config) does not change how text becomes ids.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


# Tokenizer classes that name the generic backend, and model types for which
# AutoTokenizer keeps a folder's own class (it maps them to no class of their own, or
# to the generic one, and does not override their hub class): for these it loads
# TokenizersBackend (checked against AutoTokenizer in tests/unit/test_model_files.py).
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_GENERIC_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral"})


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a Hugging Face model folder (see paths.resolve_model_path)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder not found: {folder}")
    if _loads_as_generic_backend(folder):
        generic: PreTrainedTokenizerBase = TokenizersBackend.from_pretrained(
            str(folder), local_files_only=True
        )
        return generic
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(folder), local_files_only=True
    )
    return tokenizer


def _loads_as_generic_backend(folder: Path) -> bool:
    """Whether AutoTokenizer would load this folder as the generic TokenizersBackend: its
    tokenizer_config names it, with no custom code, for a model type in
    _GENERIC_MODEL_TYPES, and a tokenizer.json holds the whole tokenizer."""
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        model_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(tokenizer_config, dict)
        and isinstance(model_config, dict)
        and tokenizer_config.get("tokenizer_class") in _GENERIC_CLASSES
        and "auto_map" not in tokenizer_config
        and "auto_map" not in model_config
        and model_config.get("model_type") in _GENERIC_MODEL_TYPES
        and (folder / "tokenizer.json").is_file()
    )


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of `messages` rendered with the model's template, ending with the assistant
    prompt; `tools` (OpenAI's tool list) for a template that reads them; `template_kwargs`:
    more variables for the template (e.g. Qwen3's `enable_thinking`);
    `continue_final_message`: the last message left open for the answer to continue
    (no new assistant prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model has no chat template; use a completion endpoint with a plain prompt"
        )
    # Render to text, then encode without extra special tokens: the same ids transformers
    # produces with tokenize=True, without depending on its return type (list vs dict
    # changed between major versions).
    tool_list: list[Any] | None = None if tools is None else list(tools)
    text = tokenizer.apply_chat_template(
        messages,
        tools=tool_list,
        tokenize=False,
        add_generation_prompt=not continue_final_message,
        continue_final_message=continue_final_message,
        **(template_kwargs or {}),
    )
    if not isinstance(text, str):
        raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def tokenizer_id(model_dir: str | Path) -> str:
    """A name for the tokenizer in `model_dir` that is the same on every host: a hash of
    its files, so grammars compiled for it (`protocol.grammar_key`) are shared only by
    services that tokenize alike."""
    folder = Path(model_dir)
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            data = path.read_bytes()
            digest.update(name.encode())
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return f"tok-{digest.hexdigest()[:16]}"
