"""What a request asks its output to follow, in each spelling clients send -> one Grammar.

OpenAI's `response_format` (`json_object`, `json_schema` with its `schema`, strict or not;
the Responses API's `text.format`), vLLM's `structured_outputs` ({"json" | "regex" |
"choice" | "grammar" | "json_object"}) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, and llama.cpp's `grammar` (GBNF) and `json_schema`. A
request may ask for one; two are refused, as is a tool-call constraint beside one.
"""

from __future__ import annotations

from typing import Any, Literal

from specserve.grammar.formats import Grammar, GrammarError, Kind, tool_calls
from specserve.server.errors import ApiError
from specserve.server.protocol import ChatCompletionRequest, GenerationRequest, ResponsesRequest

# vLLM's structured_outputs keys, and the field of its older spelling
_VLLM: dict[str, Kind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
_EXTRA: dict[str, Kind] = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "grammar": "grammar",  # llama.cpp's GBNF
    "json_schema": "json_schema",  # llama.cpp's
}


def requested(body: GenerationRequest) -> Grammar | None:
    """The grammar the body asks its output to follow, if any (a 400 for two of them)."""
    found = [g for g in (_response_format(body), *_extensions(body)) if g is not None]
    if len(found) > 1:
        fields = ", ".join(g.field for g in found)
        raise ApiError(400, f"ask for one output format, got {fields}", param=found[1].field)
    return found[0] if found else None


def _response_format(body: GenerationRequest) -> Grammar | None:
    responses = isinstance(body, ResponsesRequest)
    field = "text.format" if responses else "response_format"
    fmt = body.response_format
    if isinstance(body, ResponsesRequest) and body.text is not None:
        fmt = body.text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar("json_object", None, field)
    if fmt.type != "json_schema":
        raise ApiError(
            400,
            f"{field} type {fmt.type!r} is not supported: text, json_object or json_schema",
            param=field,
        )
    extra = fmt.model_extra or {}
    # chat completions nest it ({"json_schema": {"name", "schema", "strict"}}); the
    # Responses API has its fields in the format itself
    spec = extra.get("json_schema", extra) if not responses else extra
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{field}: json_schema needs a schema object", param=field)
    return Grammar("json_schema", schema, field)


def _extensions(body: GenerationRequest) -> list[Grammar]:
    extra = body.model_extra or {}
    found = [Grammar(kind, extra[name], name) for name, kind in _EXTRA.items() if extra.get(name)]
    vllm = extra.get("structured_outputs")
    if vllm is None:
        return found
    if not isinstance(vllm, dict):
        raise ApiError(400, "structured_outputs must be an object", param="structured_outputs")
    if vllm.get("json_object"):
        found.append(Grammar("json_object", None, "structured_outputs.json_object"))
    for key, kind in _VLLM.items():
        if vllm.get(key) is not None:
            found.append(Grammar(kind, vllm[key], f"structured_outputs.{key}"))
    return found


def tool_grammar(
    body: ChatCompletionRequest, offered: list[Any], tags_are_tokens: bool
) -> Grammar | None:
    """The calls the reply may make, by tool_choice: "required" or a named function force
    a call (of that function), "auto" holds a call once begun to the tools' schemas."""
    choice = body.tool_choice
    parallel = body.model_extra.get("parallel_tool_calls", True) if body.model_extra else True
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        named = [t for t in offered if t["function"]["name"] == name]
        if choice.get("type") != "function" or not named:
            raise ApiError(
                400,
                'tool_choice names a tool: {"type": "function", "function": {"name": '
                f"<one of the offered tools>}}}}, got {choice!r}",
                param="tool_choice",
            )
        return _tool_calls(named, "required", False, tags_are_tokens)
    mode: Literal["required", "auto"] = "required" if choice == "required" else "auto"
    return _tool_calls(offered, mode, parallel is not False, tags_are_tokens)


def _tool_calls(
    tools: list[Any], mode: Literal["required", "auto"], parallel: bool, tags: bool
) -> Grammar:
    try:
        return tool_calls(tools, mode, parallel, tags)
    except GrammarError as e:
        raise ApiError(400, str(e), param="tools") from e
