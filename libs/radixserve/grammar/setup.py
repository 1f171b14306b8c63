"""Build the grammar service's registry for a model folder (its tokenizer and vocabulary)."""

from __future__ import annotations

from pathlib import Path

from radixserve.grammar.registry import (
    GrammarRegistry,
    RegistrySettings,
    RemoteGrammarCache,
    Spawn,
)


def registry_for_model(
    model: str | Path | None,
    *,
    remote: RemoteGrammarCache | None,
    compile_timeout_s: float = 4.0,
    compile_threads: int = 2,
    spawn: Spawn | None = None,
) -> GrammarRegistry:
    """`model` None: the embedded SmolLM2 (as every service resolves it). Blocking: loads
    the tokenizer and builds xgrammar's tokenizer info (call it off the event loop)."""
    from concurrent.futures import ThreadPoolExecutor

    from radixserve.engine.model.config import ModelConfig
    from radixserve.engine.model.loader import resolve_model_path
    from radixserve.engine.model.tokenizer import load_tokenizer
    from radixserve.grammar.compile import XGrammarCompiler
    from radixserve.grammar.registry import entry_builder
    from radixserve.prep.prompt import tokenizer_id

    folder = Path(resolve_model_path(str(model) if model is not None else None))
    # The model's logits width (the bitmask's), which a padded vocabulary makes larger
    # than the tokenizer's: a worker reads the artifact only if both agree.
    vocab_size = ModelConfig.from_pretrained(folder).vocab_size
    compiler = XGrammarCompiler.for_tokenizer(load_tokenizer(folder), vocab_size)
    name = tokenizer_id(folder)
    return GrammarRegistry(
        build=entry_builder(compiler, name),
        tokenizer_id=name,
        remote=remote,
        settings=RegistrySettings(compile_timeout_s=compile_timeout_s),
        executor=ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar-compile"),
        spawn=spawn,
        vocab_size=vocab_size,
    )
