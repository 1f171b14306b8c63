"""Our Llama-family model over the paged KV pool against Hugging Face transformers' forward.

Every comparison runs several requests of different lengths in ONE batch, so the
flattening, the padding and the per-request masks are exercised together.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.engine.forward_batch import ForwardMode
from radixserve.engine.model.llama import LlamaForCausalLM
from radixserve.engine.model.loader import load_model
from radixserve.model_files.config import ModelConfig
from tests.helpers.model_harness import ModelHarness
from tests.helpers.tiny_models import make_tiny_llama, make_tiny_qwen2

ATOL, RTOL = 1e-4, 1e-5
LENGTHS = [2, 9, 24, 41]  # the first request's second half is one token: a mixed batch


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), seed=2)


@pytest.fixture(scope="module")
def tiny_llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,  # small, so short prompts hit all three bands
    }
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama3"), seed=3, rope_scaling=scaling)


@pytest.fixture(scope="module")
def tiny_yarn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_yarn"), seed=4, rope_scaling=scaling)


MODELS = [
    "tiny_llama_dir",
    "tiny_qwen3_dir",
    "tiny_qwen2_dir",
    "tiny_llama3_rope_dir",
    "tiny_yarn_dir",
    "smollm2_dir",
]


@pytest.fixture(scope="module", params=MODELS)
def harness(request: pytest.FixtureRequest) -> ModelHarness:
    return ModelHarness(request.getfixturevalue(request.param))


def prompts(vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.mark.slow
def test_extend_batch_matches_hf(harness: ModelHarness) -> None:
    seqs = prompts(harness.config.vocab_size, seed=0)
    rows = [harness.requests.new_request() for _ in seqs]
    logits = harness.run(
        harness.requests.build(ForwardMode.EXTEND, list(zip(rows, seqs, strict=True)))
    )
    assert logits.shape == (len(seqs), harness.config.vocab_size)
    assert logits.dtype == torch.float32
    expected = torch.stack([harness.reference_logits(ids)[-1] for ids in seqs])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_prefix_extend_then_decode_matches_hf(harness: ModelHarness) -> None:
    seqs = prompts(harness.config.vocab_size, seed=1)
    follow = [s[0] for s in prompts(harness.config.vocab_size, seed=2)]  # one decode token each
    rows = [harness.requests.new_request() for _ in seqs]
    halves = [len(ids) // 2 for ids in seqs]
    full = [[*ids, t] for ids, t in zip(seqs, follow, strict=True)]
    expected = [harness.reference_logits(ids) for ids in full]

    first = harness.requests.build(
        ForwardMode.EXTEND, [(r, ids[:h]) for r, ids, h in zip(rows, seqs, halves, strict=True)]
    )
    first_logits = harness.run(first)
    want = torch.stack([e[h - 1] for e, h in zip(expected, halves, strict=True)])
    torch.testing.assert_close(first_logits, want, atol=ATOL, rtol=RTOL)

    # The second halves reuse the first halves' KV slots as a cached prefix.
    second = harness.requests.build(
        ForwardMode.EXTEND, [(r, ids[h:]) for r, ids, h in zip(rows, seqs, halves, strict=True)]
    )
    assert second.extend_prefix_lens_cpu == halves
    second_logits = harness.run(second)
    want = torch.stack([e[len(ids) - 1] for e, ids in zip(expected, seqs, strict=True)])
    torch.testing.assert_close(second_logits, want, atol=ATOL, rtol=RTOL)

    decode = harness.requests.build(
        ForwardMode.DECODE, [(r, [t]) for r, t in zip(rows, follow, strict=True)]
    )
    decode_logits = harness.run(decode)
    want = torch.stack([e[-1] for e in expected])
    torch.testing.assert_close(decode_logits, want, atol=ATOL, rtol=RTOL)


def test_bfloat16_load_tracks_float32(tiny_llama_dir: Path) -> None:
    fp32 = ModelHarness(tiny_llama_dir)
    bf16 = ModelHarness(tiny_llama_dir, dtype=torch.bfloat16)
    assert bf16.model.lm_head.weight.dtype == torch.bfloat16
    seqs = prompts(fp32.config.vocab_size, seed=5)
    outs = []
    for harness in (fp32, bf16):
        rows = [harness.requests.new_request() for _ in seqs]
        batch = harness.requests.build(ForwardMode.EXTEND, list(zip(rows, seqs, strict=True)))
        outs.append(harness.run(batch))
    assert outs[1].dtype == torch.bfloat16  # the head's dtype; the sampler widens them
    torch.testing.assert_close(outs[1].float(), outs[0], atol=0.15, rtol=0.05)


def test_tied_head_shares_the_embedding(tiny_qwen3_dir: Path, tiny_llama_dir: Path) -> None:
    tied, config = load_model(tiny_qwen3_dir, "float32", "cpu")
    assert config.tie_word_embeddings and config.qk_norm
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied, config = load_model(tiny_llama_dir, "float32", "cpu")
    assert not config.tie_word_embeddings
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_converted_smollm2_answers_sensibly(smollm2_dir: Path) -> None:
    """Greedy decoding through our stack: a wrong GGUF q/k un-permutation would not say Paris."""
    from radixserve.model_files.tokenizer import apply_chat_template, load_tokenizer

    harness = ModelHarness(smollm2_dir)
    tokenizer = load_tokenizer(smollm2_dir)
    ids = apply_chat_template(
        tokenizer, [{"role": "user", "content": "What is the capital of France?"}]
    )
    row = harness.requests.new_request()
    logits = harness.run(harness.requests.build(ForwardMode.EXTEND, [(row, ids)]))
    out: list[int] = []
    for _ in range(12):
        out.append(int(logits[0].argmax()))
        logits = harness.run(harness.requests.build(ForwardMode.DECODE, [(row, [out[-1]])]))
    assert "Paris" in tokenizer.decode(out)


def _rewrite_weights(src: Path, dst: Path, drop: str | None = None, add: str | None = None) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(3)
    save_file(tensors, str(dst / "model.safetensors"))


def test_missing_weight_is_an_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    _rewrite_weights(tiny_llama_dir, tmp_path / "m", drop="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(
        ValueError, match=r"lacks 1 weights: model\.layers\.1\.self_attn\.qkv_proj\.weight\[1\]"
    ):
        load_model(tmp_path / "m", "float32", "cpu")


def test_unexpected_weight_is_an_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    _rewrite_weights(tiny_llama_dir, tmp_path / "m", add="model.layers.0.mystery.weight")
    with pytest.raises(ValueError, match="unexpected weight"):
        load_model(tmp_path / "m", "float32", "cpu")


def test_rotary_table_matches_hf_for_each_rope_type(
    tiny_llama3_rope_dir: Path, tiny_yarn_dir: Path
) -> None:
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for folder in (tiny_llama3_rope_dir, tiny_yarn_dir):
        config = ModelConfig.from_pretrained(folder)
        assert config.rope_type in ("llama3", "yarn")
        ours = LlamaForCausalLM(config)
        ours.init_rotary(64)
        assert ours.rotary is not None
        reference = LlamaRotaryEmbedding(AutoConfig.from_pretrained(folder))
        positions = torch.arange(64)[None]
        cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions)
        torch.testing.assert_close(ours.rotary.cos, cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.rotary.sin, sin[0], atol=1e-6, rtol=0)


# -- model path resolution, GGUF conversion, tokenizer --------------------------------------


def test_embedded_model_resolves_from_cache(smollm2_dir: Path) -> None:
    import time

    from radixserve.model_files.gguf_convert import embedded_gguf_path
    from radixserve.model_files.paths import resolve_model_path

    start = time.perf_counter()
    again = resolve_model_path(None)
    assert time.perf_counter() - start < 0.5  # a cache hit, no re-conversion
    assert again == smollm2_dir
    assert resolve_model_path("") == smollm2_dir
    assert resolve_model_path(str(embedded_gguf_path())) == smollm2_dir
    assert resolve_model_path(smollm2_dir) == smollm2_dir
    assert not list(smollm2_dir.parent.glob(f".{smollm2_dir.name}-*"))  # no staging left over
    config = ModelConfig.from_pretrained(smollm2_dir)
    assert (config.architecture, config.num_hidden_layers, config.vocab_size) == (
        "LlamaForCausalLM",
        30,
        49152,
    )


def test_bad_model_paths_are_refused(tmp_path: Path) -> None:
    from radixserve.model_files.paths import resolve_model_path

    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="neither"):
        resolve_model_path(tmp_path)  # a folder without config.json
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither"):
        resolve_model_path(tmp_path / "weights.bin")


def test_failed_conversion_leaves_no_folder(tmp_path: Path) -> None:
    from radixserve.model_files.gguf_convert import convert_gguf

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    cache = tmp_path / "cache"
    with pytest.raises(Exception):  # noqa: B017 - gguf's own parse error type
        convert_gguf(bad, cache)
    assert list((cache / "models").iterdir()) == []


def test_conversion_key_follows_file_content(tmp_path: Path) -> None:
    import os
    import shutil

    from radixserve.model_files.gguf_convert import converted_dir

    model = tmp_path / "m.gguf"
    model.write_bytes(b"a" * 100)
    first = converted_dir(model, tmp_path)
    assert converted_dir(model, tmp_path) == first
    # The same bytes elsewhere (a reinstall in a new virtualenv) reuse the conversion.
    (tmp_path / "elsewhere").mkdir()
    copy = tmp_path / "elsewhere" / "m.gguf"
    shutil.copyfile(model, copy)
    os.utime(copy, ns=(0, 10**9))
    assert converted_dir(copy, tmp_path) == first
    # Other bytes of the same size and name do not.
    model.write_bytes(b"b" * 100)
    os.utime(model, ns=(0, 2 * 10**9))
    assert converted_dir(model, tmp_path) != first


def test_converted_folder_is_readable_by_other_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stat

    from radixserve.model_files import gguf_convert

    def write_folder(gguf_path: Path, out: Path, weights: str) -> None:
        (out / "config.json").write_text("{}")

    # The conversion itself is tested on the real GGUF above; this is the folder's mode
    # (a 0700 folder crash-looped every non-root service of the images).
    monkeypatch.setattr(gguf_convert, "_write_hf_folder", write_folder)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"a" * 100)
    target = gguf_convert.convert_gguf(model, tmp_path / "cache")
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_stale_staging_folders_are_removed(tmp_path: Path) -> None:
    import os

    from radixserve.model_files.gguf_convert import convert_gguf

    models = tmp_path / "cache" / "models"
    stale, fresh = models / ".broken-abc", models / ".broken-def"
    stale.mkdir(parents=True)
    fresh.mkdir()
    os.utime(stale, (0, 0))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(Exception):  # noqa: B017 - gguf's own parse error type
        convert_gguf(bad, tmp_path / "cache")
    assert sorted(p.name for p in models.iterdir()) == [".broken-def"]


def test_chat_template_and_eos_survive_conversion(smollm2_dir: Path) -> None:
    from radixserve.model_files.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    assert tokenizer.chat_template is not None
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "Hi there"}])
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ModelConfig.from_pretrained(smollm2_dir).eos_token_ids == (im_end,)
    assert tokenizer.eos_token_id == im_end


def test_model_without_chat_template_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from radixserve.model_files.tokenizer import apply_chat_template, load_tokenizer

    folder = tmp_path / "plain"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(load_tokenizer(folder), [{"role": "user", "content": "Hi"}])


# -- ModelConfig parsing ----------------------------------------------------------------------

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 100,
}


def test_config_reads_old_and_new_rope_layouts() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = ModelConfig.from_dict(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}}
    )
    new = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling
    assert new.rope_type == "llama3"
    plain = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    )
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_config_defaults_and_flags() -> None:
    llama = ModelConfig.from_dict(BASE, {"eos_token_id": [7, 9]})
    assert llama.head_dim == 16 and llama.num_key_value_heads == 4
    assert not (llama.qkv_bias or llama.o_bias or llama.qk_norm)
    assert llama.eos_token_ids == (7, 9)
    qwen2 = ModelConfig.from_dict(
        {
            **BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "eos_token_id": 9,
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
    assert qwen2.eos_token_ids == (9,)
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32
    mistral = ModelConfig.from_dict(
        {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    )
    assert mistral.sliding_window == 4096


@pytest.mark.parametrize(
    "override,message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported model architecture"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_config_refuses_what_it_cannot_run(override: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **override})


def test_dummy_load_format_needs_only_the_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import shutil

    from radixserve import Engine

    folder = tmp_path / "config_only"
    folder.mkdir()
    for item in tiny_llama_dir.iterdir():
        if not item.name.endswith(".safetensors"):
            shutil.copy(item, folder / item.name)
    engine = Engine(model_path=str(folder), load_format="dummy", device="cpu")
    weight = engine.runner.model.model.layers[0].mlp.down_proj.weight
    assert weight.abs().sum() > 0 and weight.std() < 1.0
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})
    assert isinstance(out, dict) and len(out["output_ids"]) == 4
    with pytest.raises(ValueError, match="load_format"):
        Engine(model_path=str(folder), load_format="bogus")


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_by_device_and_cpu(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto': the config's dtype on a GPU; on the CPU bfloat16 only for a bfloat16 model
    on a CPU that multiplies bfloat16 natively, else float32; a named dtype as named."""
    from radixserve.engine.model import loader

    monkeypatch.setattr(loader, "cpu_multiplies_bfloat16", lambda: native)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")

    def config(dtype: str | None) -> ModelConfig:
        return ModelConfig.from_dict({**BASE, "torch_dtype": dtype})

    assert loader.resolve_dtype("auto", cpu, config("bfloat16")) == (
        torch.bfloat16 if native else torch.float32
    )
    for other in ("float32", "float16", None):
        assert loader.resolve_dtype("auto", cpu, config(other)) == torch.float32
    assert loader.resolve_dtype("auto", gpu, config("float16")) == torch.float16
    assert loader.resolve_dtype("auto", gpu, config(None)) == torch.bfloat16
    assert loader.resolve_dtype("float32", cpu, config("bfloat16")) == torch.float32
    assert loader.resolve_dtype(torch.float16, cpu, config("bfloat16")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be auto"):
        loader.resolve_dtype("fp8", cpu, config("bfloat16"))
