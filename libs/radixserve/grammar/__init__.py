"""Structured outputs: grammar compilation with xgrammar, caching and serialization.

    source = GrammarSource("json_schema", '{"type": "object", ...}')
    compiler = GrammarCompilerHandle.for_tokenizer(hf_tokenizer, vocab_size)
    compiled = compiler.compile(source)            # InvalidGrammar: a 400 with the message
    blob = serialize(compiled)                      # what the grammar service stores and sends
    again = deserialize(blob, compiler.info)        # a worker loads it without recompiling

The grammar service (`registry.GrammarRegistry`) and the engine
(`radixserve.engine.constrained`) share these functions, so a grammar means the same
thing wherever it is compiled. Importing this package does not import xgrammar (a
few seconds): the modules that need it import it when first used.
"""

from __future__ import annotations

from radixserve.grammar.source import (
    GRAMMAR_KINDS,
    GrammarSource,
    InvalidGrammar,
    grammar_source_of,
)

__all__ = ["GRAMMAR_KINDS", "GrammarSource", "InvalidGrammar", "grammar_source_of"]
