"""The CPU services need no torch: importing the tokenizer, grammar, detokenizer and
gateway services, and the start-up work of the three that read the model's files
(resolve the model, load its tokenizer and config), leave torch unimported. Each check
runs in a fresh interpreter, since this one has torch loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SERVICE_MODULES = (
    "radixserve.services.tokenizer",
    "radixserve.services.grammar",
    "radixserve.services.detokenizer",
    "radixserve.services.gateway",
)

# What a fresh interpreter reports after running `code`: the heavy modules it loaded.
_REPORT = """
import json, sys
print(json.dumps(sorted(m for m in ("torch", "triton", "xgrammar") if m in sys.modules)))
"""


def _loaded_after(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code + _REPORT],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


@pytest.mark.parametrize("module", SERVICE_MODULES)
def test_service_module_imports_without_torch(module: str) -> None:
    assert _loaded_after(f"import {module}") == []


def test_the_report_sees_torch_when_it_is_imported() -> None:
    assert _loaded_after("import torch") == ["torch"]


def test_start_up_of_the_tokenizer_detokenizer_and_grammar_services_without_torch(
    smollm2_dir: Path,
) -> None:
    """The embedded model (converted once, by the fixture) resolved, its tokenizer loaded
    as the tokenizer service (the prompt tokenizer) and the detokenizer load it, and what
    the grammar service's parent reads (config, tokenizer id)."""
    code = f"""
from pathlib import Path
from radixserve.model_files.config import ModelConfig
from radixserve.model_files.paths import resolve_model_path
from radixserve.model_files.tokenizer import tokenizer_id
from radixserve.prep import load_prompt_tokenizer
from radixserve.services.detokenizer import load_tokenizer

folder = resolve_model_path(None)
assert folder == Path({str(smollm2_dir)!r}), folder
prompter = load_prompt_tokenizer(folder, None)
assert prompter.vocab_size == ModelConfig.from_pretrained(folder).vocab_size
assert len(load_tokenizer(None)) == prompter.vocab_size
assert tokenizer_id(folder).startswith("tok-")
"""
    assert _loaded_after(code) == []
