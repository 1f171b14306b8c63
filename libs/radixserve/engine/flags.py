"""Command-line flags for every `EngineConfig` field: `--chunked-prefill-size` = `chunked_prefill_size`.

Generated from the dataclass, so the worker's flags, `radixserve up`/`generate` and
`Engine(**kwargs)` can never drift. `--model` is `model_path`. A flag left unset
falls back to `RADIXSERVE_<FIELD>` in the environment, then to the config default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from radixserve.engine.config import EngineConfig

_HIDDEN = {"debug_check_invariants"}  # tests only
# What an unset option (None) means, for --help.
_UNSET_HELP = {
    "model_path": "HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)",
    "max_total_tokens": "KV pool size in tokens (default: from mem_fraction_static on a GPU)",
    "max_running_requests": "default: 512 on a GPU of 70 GiB or more, else 256",
    "cuda_graph_max_bs": "default: as max_running_requests",
    "quantization": "fp8: quantize a 16-bit checkpoint's projections on load "
    "(default: as the checkpoint is)",
    "gguf_weights": "a .gguf model: quantized (its blocks kept) or dequantized (float32) "
    "(default: quantized on CUDA, dequantized on the CPU)",
    "context_length": "default: the model's max_position_embeddings",
    "prefill_attention_backend": "torch, triton or flashinfer (default: as --attention-backend)",
    "decode_attention_backend": "torch, triton or flashinfer (default: as --attention-backend; "
    "auto decodes with triton)",
}


def _flag(name: str) -> str:
    return "--model" if name == "model_path" else "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


def _converter(field: dataclasses.Field[Any]) -> Any:
    kind = str(field.type)
    if "bool" in kind:
        return _parse_bool
    if "int" in kind:
        return int
    if "float" in kind:
        return float
    return str


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineConfig):
        if field.name in _HIDDEN:
            continue
        help_text = (
            f"default {field.default!r}"
            if field.default is not None
            else _UNSET_HELP.get(field.name)
        )
        if "bool" in str(field.type):
            group.add_argument(
                _flag(field.name),
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            group.add_argument(
                _flag(field.name),
                dest=field.name,
                type=_converter(field),
                default=None,
                help=help_text,
            )


def engine_kwargs(
    ns: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The EngineConfig keyword arguments given by flags or `RADIXSERVE_*` variables."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for field in dataclasses.fields(EngineConfig):
        value = getattr(ns, field.name, None)
        if value is None:
            env_name = (
                "RADIXSERVE_MODEL"
                if field.name == "model_path"
                else f"RADIXSERVE_{field.name.upper()}"
            )
            raw = env.get(env_name, "").strip()
            if raw:
                try:
                    value = _converter(field)(raw)
                except ValueError as exc:  # name the variable: the value alone says little
                    raise ValueError(f"{env_name}={raw!r}: {exc}") from exc
        if value is not None:
            out[field.name] = value
    return out


def engine_argv(kwargs: Mapping[str, Any]) -> list[str]:
    """The flags that reproduce `kwargs` (for a child process: the workers of `up`)."""
    argv: list[str] = []
    for name, value in kwargs.items():
        flag = _flag(name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv
