"""The engine's grammar side: compiled grammars for this model, and per-request states.

    backend = GrammarBackend(tokenizer, vocab_size=runner.vocab_size)
    compiled = backend.compile(GrammarSource("regex", r"\\d{3}"))        # in-process
    compiled = backend.load(key, artifact, fmt) or backend.compile_keyed(key, source)
    req.grammar = backend.new_state(compiled, req.stop_token_ids, req.params)

xgrammar's tokenizer info is built on first use (about 0.3 s for a 49k vocabulary).
Compiled grammars are kept in a small LRU by key, so the requests of one schema
compile or load it once. Thread-safe: the worker loads grammars off its event loop
while the engine thread runs steps.
"""

from __future__ import annotations

import threading
from collections.abc import Set
from typing import TYPE_CHECKING

from radixserve.engine.constrained.state import GrammarState
from radixserve.grammar.lru import BoundedLru
from radixserve.grammar.source import GrammarSource, InvalidGrammar, grammar_source_of
from radixserve.protocol.grammar import grammar_key

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

    from radixserve.engine.sampling.params import SamplingParams
    from radixserve.grammar.compile import XGrammarCompiler

# Keys of grammars compiled in-process (`Engine.generate`) name this pseudo-tokenizer,
# so they never collide with the grammar service's keys.
LOCAL_TOKENIZER_ID = "engine-local"


class GrammarBackend:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        *,
        jump_forward: bool = True,
        cache_entries: int = 64,
        cache_bytes: int = 512 * 1024 * 1024,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # Append the continuation a grammar forces without a forward pass per token.
        self.jump_forward = jump_forward
        self._lock = threading.Lock()
        self._compiler: XGrammarCompiler | None = None
        self._compiled: BoundedLru[xgr.CompiledGrammar] = BoundedLru(
            cache_entries, cache_bytes, lambda g: int(g.memory_size_bytes)
        )

    def warm_up(self) -> None:
        """Import xgrammar and build the tokenizer info now (a few seconds) rather than on
        the first constrained request. A server calls it before its engine thread runs:
        building the info encodes with the tokenizer, which must not race the engine's
        own use of it."""
        _ = self.compiler

    @property
    def compiler(self) -> XGrammarCompiler:
        with self._lock:
            if self._compiler is None:
                from radixserve.grammar.compile import XGrammarCompiler

                self._compiler = XGrammarCompiler.for_tokenizer(self.tokenizer, self.vocab_size)
            return self._compiler

    # -- compiled grammars ---------------------------------------------------------------
    def cached(self, key: str) -> xgr.CompiledGrammar | None:
        with self._lock:
            return self._compiled.get(key)

    def compile(self, source: GrammarSource) -> xgr.CompiledGrammar:
        """Compile in this process (cached); InvalidGrammar when the compiler refuses."""
        return self.compile_keyed(
            grammar_key(source.kind, source.source, LOCAL_TOKENIZER_ID), source
        )

    def compile_request(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        """A request's grammar (its regex / json_schema / ebnf / structural_tag) compiled
        here, None when unconstrained; ValueError naming the parameter when invalid."""
        source = grammar_source_of(lambda name: getattr(params, name, None))
        if source is None:
            return None
        try:
            return self.compile(source)
        except InvalidGrammar as exc:
            raise ValueError(
                f"sampling parameter {source.param!r} is not a valid grammar: {exc.message}"
            ) from exc

    def compile_keyed(self, key: str, source: GrammarSource) -> xgr.CompiledGrammar:
        compiled = self.cached(key)
        if compiled is None:
            compiled = self.compiler.compile(source)
            self._remember(key, compiled)
        return compiled

    def load(self, key: str, artifact: bytes, fmt: str | None) -> xgr.CompiledGrammar:
        """The grammar service's artifact, deserialized for this model (cached by key);
        ArtifactMismatch when it was built for another vocabulary or xgrammar."""
        from radixserve.grammar.artifact import deserialize

        compiled = self.cached(key)
        if compiled is None:
            compiled = deserialize(artifact, self.compiler.info, fmt)
            self._remember(key, compiled)
        return compiled

    def _remember(self, key: str, compiled: xgr.CompiledGrammar) -> None:
        with self._lock:
            self._compiled.put(key, compiled)

    # -- per request -------------------------------------------------------------------------
    def new_state(
        self, compiled: xgr.CompiledGrammar, stop_token_ids: Set[int], params: SamplingParams
    ) -> GrammarState:
        """A fresh matcher for one request (one choice): it ends on the request's own stop
        tokens, or, when it has none (ignore_eos), as soon as the grammar is complete."""
        import xgrammar as xgr

        stops = sorted(stop_token_ids)
        matcher = xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=stops or None,
            terminate_without_stop_token=not stops,
        )
        return GrammarState(
            matcher,
            encode=self._encode,
            decode=self._decode,
            jump_forward=self.jump_forward and not params.return_logprob,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))
