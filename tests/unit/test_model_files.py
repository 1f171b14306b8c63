"""`model_files.tokenizer.load_tokenizer` loads, without torch, the tokenizer
AutoTokenizer loads: the same class and the same ids, for the folders it loads directly
and for those it leaves to AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from radixserve.model_files import tokenizer as model_tokenizer
from tests.helpers.tiny_models import make_tiny_qwen2

TEXTS = ("Hello, world!", "  two  spaces\nand a newline ", "日本語 and émojis 🎉", "")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _same_as_auto(folder: Path) -> type:
    ours = model_tokenizer.load_tokenizer(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert type(ours) is type(theirs)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))
    assert model_tokenizer.apply_chat_template(ours, CHAT) == model_tokenizer.apply_chat_template(
        theirs, CHAT
    )
    assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        len(theirs),
    )
    return type(ours)


def _folder_like(source: Path, out: Path, model_type: str, tokenizer_class: str) -> Path:
    """`source`'s tokenizer files with another model type and declared tokenizer class."""
    out.mkdir()
    for name in (*model_tokenizer._TOKENIZER_FILES, "config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    declared = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(
        json.dumps({**declared, "tokenizer_class": tokenizer_class})
    )
    return out


def test_the_embedded_and_tiny_llama_tokenizers_load_directly(
    smollm2_dir: Path, tiny_llama_dir: Path
) -> None:
    for folder in (smollm2_dir, tiny_llama_dir):
        assert model_tokenizer._loads_as_generic_backend(folder)
        assert _same_as_auto(folder).__name__ == "TokenizersBackend"


@pytest.mark.parametrize("model_type", sorted(model_tokenizer._GENERIC_MODEL_TYPES))
@pytest.mark.parametrize("tokenizer_class", sorted(model_tokenizer._GENERIC_CLASSES))
def test_generic_model_types_and_classes_are_what_autotokenizer_loads(
    smollm2_dir: Path, tmp_path: Path, model_type: str, tokenizer_class: str
) -> None:
    """The premise of the direct load, checked against the installed transformers."""
    folder = _folder_like(smollm2_dir, tmp_path / "m", model_type, tokenizer_class)
    assert model_tokenizer._loads_as_generic_backend(folder)
    assert _same_as_auto(folder).__name__ == "TokenizersBackend"


def test_other_folders_go_through_autotokenizer(smollm2_dir: Path, tmp_path: Path) -> None:
    """A Qwen2 folder (AutoTokenizer overrides its declared class), a declared model
    class, custom code: AutoTokenizer decides, and load_tokenizer returns its choice."""
    qwen2 = Path(make_tiny_qwen2(tmp_path / "qwen2"))
    assert not model_tokenizer._loads_as_generic_backend(qwen2)
    assert _same_as_auto(qwen2).__name__ == "Qwen2Tokenizer"
    declared = _folder_like(smollm2_dir, tmp_path / "gpt2", "llama", "GPT2Tokenizer")
    assert not model_tokenizer._loads_as_generic_backend(declared)
    _same_as_auto(declared)
    remote = _folder_like(smollm2_dir, tmp_path / "remote", "llama", "TokenizersBackend")
    config = json.loads((remote / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_x.XTokenizer"]}
    (remote / "tokenizer_config.json").write_text(json.dumps(config))
    assert not model_tokenizer._loads_as_generic_backend(remote)


def test_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer folder not found"):
        model_tokenizer.load_tokenizer(tmp_path / "nowhere")
