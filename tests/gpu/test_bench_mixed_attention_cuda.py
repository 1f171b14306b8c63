"""lab/probes/mixed_attention.py on CUDA: every way of running a mixed step's attention (the
decoders' cascade beside the prompts' prefill) gives the engine's output bit for bit."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer is not installed")

pytestmark = pytest.mark.gpu

PROBES_DIR = Path(__file__).resolve().parents[2] / "lab" / "probes"


@pytest.mark.parametrize("step", ["question", "prefix"])
def test_every_way_matches_the_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], step: str
) -> None:
    monkeypatch.syspath_prepend(str(PROBES_DIR))
    probe = importlib.import_module("mixed_attention")
    # 40 decoders: two groups of 16 and one of 8; the main() asserts the outputs.
    args = ["--decoders", "40", "--step", step, "--repeat", "2", "--rounds", "1"]
    assert probe.main(args) == 0
    out = capsys.readouterr().out
    for way in probe.WAYS:
        assert f"  {way} " in out
