"""Build the grammar service's registry for a model folder (its tokenizer and vocabulary)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from radixserve.grammar.registry import (
    BuildEntry,
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
    compile_limit_s: float = 30.0,
    compile_workers: int = 2,
    spawn: Spawn | None = None,
    on_stop: Callable[[str], None] | None = None,
) -> GrammarRegistry:
    """`model` None: the embedded SmolLM2 (as every service resolves it). Blocking: loads
    the tokenizer, or starts the compile processes (call it off the event loop).

    `compile_limit_s` > 0: `compile_workers` child processes compile, each compile
    stopped past that limit (`processes.CompileProcesses`, which calls `on_stop(kind)`);
    0: threads compile, without a limit (a compile that never ends holds its thread).
    """
    from radixserve.model_files.config import ModelConfig
    from radixserve.model_files.paths import resolve_model_path
    from radixserve.model_files.tokenizer import tokenizer_id

    if compile_workers < 1:
        raise ValueError(f"need at least one compile worker, got {compile_workers}")
    folder = Path(resolve_model_path(str(model) if model is not None else None))
    # The model's logits width (the bitmask's), which a padded vocabulary makes larger
    # than the tokenizer's: a worker reads the artifact only if both agree.
    vocab_size = ModelConfig.from_pretrained(folder).vocab_size
    name = tokenizer_id(folder)
    build: BuildEntry
    release: Callable[[], None] | None
    if compile_limit_s > 0:
        from radixserve.grammar.processes import CompileProcesses, CompilerSpec

        processes = CompileProcesses(
            CompilerSpec(str(folder), name, vocab_size),
            compile_workers,
            compile_limit_s,
            on_stop=on_stop,
        )
        build, release = processes, processes.close
    else:
        from radixserve.grammar.compile import XGrammarCompiler
        from radixserve.grammar.registry import entry_builder
        from radixserve.model_files.tokenizer import load_tokenizer

        compiler = XGrammarCompiler.for_tokenizer(load_tokenizer(folder), vocab_size)
        build, release = entry_builder(compiler, name), None
    return GrammarRegistry(
        build=build,
        tokenizer_id=name,
        remote=remote,
        settings=RegistrySettings(compile_timeout_s=compile_timeout_s),
        executor=ThreadPoolExecutor(compile_workers, thread_name_prefix="grammar-compile"),
        spawn=spawn,
        vocab_size=vocab_size,
        release=release,
    )
