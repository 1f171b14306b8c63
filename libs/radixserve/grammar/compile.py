"""Compile a `GrammarSource` with xgrammar for one tokenizer and vocabulary size.

One set of options everywhere (grammar service, worker fallback, in-process engine),
so a key names the same grammar on every host:

- JSON schema: `any_whitespace=False` (xgrammar's compact separators `", "` and
  `": "`). A grammar that allows unbounded whitespace lets a model loop on spaces
  forever; with fixed separators every schema whose strings, numbers and arrays are
  bounded forces the output to end. `strict_mode` (xgrammar's default): no
  properties beyond those listed unless `additionalProperties` says so.
- Strings with `minLength` / `maxLength` (and no pattern of their own): xgrammar 0.2.8
  builds their characters from `[^"\\\r\n]`, which lets raw control characters
  through, and a JSON parser rejects them. Bounds up to MAX_PATTERN_BOUND are given to
  xgrammar as the equivalent `pattern` of characters that need no escape
  (`json_safe_lengths`); xgrammar expands a pattern's repetition, so larger bounds
  stay xgrammar's own (a bounded repetition in its EBNF), whose character rule is
  narrowed in the EBNF text instead (`json_schema_grammar`). Four strings of
  `maxLength` 5000 as patterns took 31 s to compile; as repetitions, 0.7-2.3 s. Small
  bounds stay patterns: their compiled grammars are several times smaller.
- regex: the whole output matches the pattern.
- EBNF: xgrammar's EBNF (GBNF-like), the start rule is `root`.
- structural tag: xgrammar's format (`{"type": "structural_tag", "format": ...}`) or
  SGLang's (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from radixserve.grammar.source import GrammarSource, InvalidGrammar

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

# xgrammar's C++ errors start with a log prefix: "[15:26:41] /project/cpp/x.cc:83: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s+")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: ")
MAX_ERROR_CHARS = 500


class XGrammarCompiler:
    """xgrammar's tokenizer info and compiler for one tokenizer (thread-safe to call)."""

    def __init__(self, info: xgr.TokenizerInfo, max_threads: int = 2) -> None:
        import xgrammar as xgr

        self.info = info
        # No xgrammar-side cache: the callers cache by grammar key (the service the
        # serialized artifact, the engine the compiled grammar) with their own bounds.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    @classmethod
    def for_tokenizer(
        cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_threads: int = 2
    ) -> XGrammarCompiler:
        """`vocab_size` is the model's logits width (may exceed the tokenizer's: padding)."""
        return cls(tokenizer_info(tokenizer, vocab_size), max_threads=max_threads)

    @property
    def vocab_size(self) -> int:
        return int(self.info.vocab_size)

    def compile(self, grammar: GrammarSource) -> xgr.CompiledGrammar:
        """The compiled grammar; InvalidGrammar with the compiler's reason if it refuses."""
        try:
            if grammar.kind == "json_schema":
                ebnf = json_schema_grammar(_json_schema(grammar.source))
                return self._compiler.compile_grammar(ebnf, root_rule_name="root")
            if grammar.kind == "regex":
                return self._compiler.compile_regex(grammar.source)
            if grammar.kind == "ebnf":
                return self._compiler.compile_grammar(grammar.source, root_rule_name="root")
            return self._compile_structural_tag(grammar.source)
        except InvalidGrammar:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar raises RuntimeError (C++), its own ValueError subclasses and
            # pydantic's ValidationError (a ValueError) for a bad structural tag.
            raise InvalidGrammar(grammar.kind, clean_error(str(exc))) from exc

    def _compile_structural_tag(self, source: str) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        spec = _json_object(source, "structural_tag")
        if "structures" in spec:  # SGLang's form: triggers + (begin, schema, end) items
            try:
                tags = [
                    xgr.StructuralTagItem(
                        begin=item["begin"], schema=json.dumps(item["schema"]), end=item["end"]
                    )
                    for item in spec["structures"]
                ]
            except (KeyError, TypeError) as exc:
                raise InvalidGrammar(
                    "structural_tag", f"each structure needs begin, schema and end ({exc!r})"
                ) from exc
            return self._compiler.compile_structural_tag(tags, spec.get("triggers", []))
        return self._compiler.compile_structural_tag(source)


def tokenizer_info(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> xgr.TokenizerInfo:
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


def clean_error(message: str) -> str:
    """xgrammar's message without its C++ log prefix, on one bounded line."""
    text = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    text = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text))
    return text[:MAX_ERROR_CHARS]


def _json_schema(source: str) -> Any:
    """The schema, checked to be a JSON object or boolean before xgrammar sees it."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        raise InvalidGrammar("json_schema", f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise InvalidGrammar(
            "json_schema", f"a JSON schema must be an object, got {type(schema).__name__}"
        )
    return schema


# Characters a JSON string holds without an escape: no control character, quote or backslash.
_UNESCAPED_CHAR = '[^\\x00-\\x1f"\\\\]'
# The largest length bound written as a pattern (its compile time grows faster than the
# bound: 0.26 s at 1024, 1.1 s at 2048, 7.4 s at 5000 for one string).
MAX_PATTERN_BOUND = 512
# xgrammar's character rule of a length-bounded string, as it prints its EBNF, and the
# same rule without the control characters (the pattern's character class).
BOUNDED_STRING_CHARS = '(([^\\"\\\\\\r\\n]))'
JSON_SAFE_CHARS = '(([^\\0-\\x1f\\"\\\\]))'


def json_schema_grammar(schema: Any) -> str:
    """xgrammar's EBNF for `schema` (compact separators, strict), every length-bounded
    plain string holding only characters a JSON string holds unescaped (see the module
    docstring)."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        json_safe_lengths(schema), any_whitespace=False, strict_mode=True
    )
    return str(grammar).replace(BOUNDED_STRING_CHARS, JSON_SAFE_CHARS)


def json_safe_lengths(schema: Any) -> str:
    """The schema as text for xgrammar, each plain string with length bounds up to
    MAX_PATTERN_BOUND rewritten as a pattern of unescaped characters with those bounds.

    Only a string schema without pattern/format/enum/const changes; the output it
    admits is a subset of what the schema allows (no escapes inside such strings).
    """

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: walk(value) for key, value in node.items()}
        types = out.get("type")
        is_string = types == "string" or (isinstance(types, list) and "string" in types)
        bounds = [b for b in (out.get("minLength"), out.get("maxLength")) if isinstance(b, int)]
        small = bool(bounds) and max(bounds) <= MAX_PATTERN_BOUND
        if is_string and small and not {"pattern", "format", "enum", "const"} & out.keys():
            low, high = out.pop("minLength", None), out.pop("maxLength", None)
            low = low if isinstance(low, int) else 0
            high_text = str(high) if isinstance(high, int) else ""
            out["pattern"] = f"^{_UNESCAPED_CHAR}{{{low},{high_text}}}$"
        return out

    return json.dumps(walk(schema))


def _json_object(source: str, kind: Any) -> dict[str, Any]:
    try:
        value = json.loads(source)
    except json.JSONDecodeError as exc:
        raise InvalidGrammar(kind, f"the {kind} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidGrammar(kind, f"the {kind} must be a JSON object")
    return value
