"""What a request asks its output to follow -> one llguidance grammar, checked.

A `Grammar` names its kind (json_schema, json_object, regex, choice, or a grammar in Lark
or llama.cpp's GBNF, told apart by the library) and its source; `tool_calls` builds the
grammar of calls of offered tools. `compile_grammar` asks the library to check it against
the vocabulary and raises `GrammarError`, quoting the library's reason, for one it cannot
compile: the client's mistake, a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from specserve.errors import SpecserveError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# Qwen's and every Hermes-style template's tool-call markup
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


# JSON laid out as json.dumps and the models' training text write it: a fixed layout leaves
# a small model no whitespace to loop on, and makes separators forced tokens (free drafts);
# a schema's own "x-guidance" options override it
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(SpecserveError):
    """A grammar the library cannot compile (its reason in the message)."""


@dataclass(frozen=True)
class Grammar:
    kind: Kind
    source: Any  # a schema (dict), a regex or grammar text, or a list of choices
    field: str = "response_format"  # the request field it came from, for error messages

    def to_llguidance(self) -> str:
        try:
            return _convert(self.kind, self.source)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{self.field}: {e}") from None


def _convert(kind: Kind, source: Any) -> str:
    if kind == "json_object":
        source = {"type": "object"}
    if kind in ("json_object", "json_schema"):
        if not isinstance(source, dict):
            raise ValueError("a JSON schema is an object")
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(source),
            defaults=JSON_LAYOUT,  # type: ignore[arg-type]
        )
    if kind == "choice":
        if not (isinstance(source, list) and source and all(isinstance(c, str) for c in source)):
            raise ValueError("choices are a non-empty list of strings")
        return llguidance.grammar_from("choice", json.dumps(source))
    if not isinstance(source, str):
        raise ValueError(f"a {kind} is text")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    return llguidance.grammar_from("grammar", source)


def compile_grammar(grammar: Grammar, vocab: llguidance.LLTokenizer) -> str:
    """The grammar, checked against the vocabulary (GrammarError if it does not compile)."""
    text = grammar.to_llguidance()
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, vocab)
    if error:
        raise GrammarError(f"{grammar.field}: the grammar does not compile: {messages[0]}")
    return text


# where a schema keeps the definitions that its "$ref"s point at from its root
_DEFS = ("$defs", "definitions")


def call_schema(tool: dict[str, Any], defs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One tool's call as the model writes it: {"name": <its name>, "arguments": {...}}.
    The parameters' definitions move into `defs`, for the root of the calls' schema: their
    "$ref"s point from the root of the document, where the parameters no longer are
    (pydantic writes nested models so)."""
    function = tool["function"]
    arguments = dict(function.get("parameters") or {"type": "object"})
    for key in _DEFS:
        for name, schema in (arguments.pop(key, None) or {}).items():
            if defs[key].setdefault(name, schema) != schema:
                raise GrammarError(f"tools: two tools define {key}/{name} differently")
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# free text under "auto" opens with neither `{` nor ```json, each of which begins a call
# that must then follow the schemas (one reading of a reply, not two); the fence's own
# beginnings stay possible as whole replies
_NOT_A_CALL = "([^{`]|`[^`]|``[^`]|```[^j]|```j[^s]|```js[^o]|```jso[^n])"
_FENCE_PREFIXES = "`|``|```|```j|```js|```jso"


def tool_calls(
    tools: list[dict[str, Any]],
    mode: Literal["required", "auto"],
    parallel: bool,
    tags_are_tokens: bool = True,
) -> Grammar:
    """Calls of `tools`: with "required", the reply is one call (several with `parallel`)
    in the template's tags; with "auto", free text, where a tagged call once begun is held
    to the tools' schemas, or a reply that opens with `{` or ```json is one bare call, as
    Qwen-Coder answers (free text may not open so: two readings of one brace would leave
    the call unconstrained). tags_are_tokens: the vocabulary spells the tags as special tokens
    (Qwen's), which free text never produces."""
    defs: dict[str, dict[str, Any]] = {key: {} for key in _DEFS}
    calls_schema = {"anyOf": [call_schema(t, defs) for t in tools], "x-guidance": JSON_LAYOUT}
    one_of = json.dumps(calls_schema | {k: v for k, v in defs.items() if v})
    # the Hermes layout, tags on lines of their own; a vocabulary without tag tokens writes
    # the tags as text, run on (a character-level one may spell no line break)
    if tags_are_tokens:
        tagged = f'call: {CALL_START} "\\n" %json {one_of} "\\n" {CALL_END}'
    else:
        tagged = f'call: "{CALL_START}" %json {one_of} "{CALL_END}"'
    # one call per line, and the reply may end after any call's line break (as llama.cpp's
    # grammar lets it): Qwen's 0.5B writes "</tool_call>\n" and then wants to end
    calls = 'calls: call ("\\n" call)* "\\n"?' if parallel else "calls: call"
    if mode == "required":
        rules = ["start: calls", calls, tagged]
    else:
        rules = [
            "start: bare | fenced | text",
            f"bare: %json {one_of}",
            # Qwen-Coder's other bare layout: the call in a ```json fence, the whole reply
            f'fenced: "```json" SPACE? %json {one_of} SPACE? "```"',
            "text: TEXT | TEXT? calls",
            calls,
            tagged,
            "SPACE: /[ \\t\\n]+/",
            f"TEXT: /{_NOT_A_CALL}(.|\\n)*|{_FENCE_PREFIXES}/",
        ]
    return Grammar("grammar", "\n".join(["%llguidance {}", *rules]), field="tools")
