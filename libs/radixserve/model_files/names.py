"""What a model is called in the API: light (no torch), so the gateway can import it."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(model_path: str | Path | None) -> str:
    """The name `/v1/models` reports for a model path: its folder or file name, without
    `.gguf`; the embedded default is SmolLM2-135M-Instruct."""
    if model_path is None or str(model_path) == "":
        return EMBEDDED_MODEL_NAME
    name = Path(model_path).expanduser().name
    return name.removesuffix(".gguf") or "model"
