"""Where a model's files are: a local folder, a GGUF file (converted once), or nothing
(the embedded SmolLM2). Light (no torch): every CPU service resolves the same path."""

from __future__ import annotations

from pathlib import Path

from radixserve.model_files.gguf_convert import DEQUANTIZED, convert_gguf, embedded_gguf_path


def resolve_model_path(
    model_path: str | Path | None, cache_dir: Path | None = None, gguf_weights: str = DEQUANTIZED
) -> Path:
    """The Hugging Face folder to load: None/"" -> the embedded SmolLM2, a .gguf -> its
    conversion (`gguf_weights`: gguf_convert.GGUF_WEIGHTS; the services that read the
    tokenizer alone take either)."""
    if model_path is None or str(model_path) == "":
        return convert_gguf(embedded_gguf_path(), cache_dir, gguf_weights)
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir, gguf_weights)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model_path!r} does not exist (paths must be local: a Hugging Face "
            "folder with config.json, or a .gguf file; nothing is downloaded)"
        )
    raise ValueError(
        f"model path {model_path!r} is neither a folder with config.json nor a .gguf file "
        "(for a folder holding a GGUF, pass the .gguf file itself)"
    )
