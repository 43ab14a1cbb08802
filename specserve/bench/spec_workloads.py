"""The prompts of `specserve bench spec` (bench/spec.py says what each workload measures)."""

from __future__ import annotations

from typing import Any

from specserve.grammar.formats import Grammar

TURN1 = (
    "Write a {program} demo in {lang}. Please, write just code. Do not write any extra comments."
)
TURN2 = "Rewrite the same program with descriptive variable names."
PROSE = "Write a short story about a lighthouse keeper."
# UNTUNED: answers of the same kinds that nothing was tuned on, since a head or a rule chosen
# by how it serves quicksort-* and prose would fit those; it is judged on these too
PROGRAMS = {"mergesort": "merge sort", "stack": "stack", "bfs": "breadth-first search"}
STORIES = {"prose": PROSE, "prose-clockmaker": "Write a short story about a clockmaker."}
JSON_ASK = (
    "List six sorting algorithms as a JSON object: for each, its average and worst time "
    "complexity, its memory use and whether it is stable."
)
LANGS = {"c": "C", "java": "Java", "python": "Python"}
# predicted-*: quicksort-*'s prompt with OpenAI's `prediction` = the model's own answer with
# identifiers renamed (EDITS): what a client holding an earlier, edited answer sends
EDITS = {"arr": "array", "pivot": "pv", "temp": "tmp"}
WORKLOADS = (
    *(f"quicksort-{k}" for k in LANGS),
    *(f"rewrite-{k}" for k in LANGS),
    *(f"predicted-{k}" for k in LANGS),
    "prose",
    "json",
    "json-schema",
    "json-free",
)
# asked for by name only (not in the default run): UNTUNED's programs and story
UNTUNED = (*(f"{p}-{k}" for p in PROGRAMS for k in LANGS), "prose-clockmaker")
# a schema-heavy reply: most of its tokens are keys, separators and enum values
SORTS = {
    "type": "object",
    "properties": {
        "algorithms": {
            "type": "array",
            "minItems": 6,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "average_time_complexity": {"enum": ["O(n log n)", "O(n^2)", "O(n)", "O(nk)"]},
                    "worst_time_complexity": {"enum": ["O(n log n)", "O(n^2)", "O(n)", "O(nk)"]},
                    "memory": {"enum": ["O(1)", "O(log n)", "O(n)", "O(n + k)"]},
                    "stable": {"type": "boolean"},
                },
                "required": [
                    "name", "average_time_complexity", "worst_time_complexity", "memory", "stable"
                ],
                "additionalProperties": False,
            },
        }
    },
    "required": ["algorithms"],
    "additionalProperties": False,
}  # fmt: skip
GRAMMARS = {"json": Grammar("json_object", None), "json-schema": Grammar("json_schema", SORTS)}


def turn1_lang(workload: str) -> str | None:
    """The language of the quicksort answer a rewrite or predicted workload builds on."""
    kind, _, lang = workload.partition("-")
    return lang if kind in ("rewrite", "predicted") else None


def messages(workload: str, turn1_answer: str | None) -> list[dict[str, Any]]:
    """The workload's chat; a rewrite quotes `turn1_answer`, the model's own turn 1."""
    if workload in STORIES:
        return [{"role": "user", "content": STORIES[workload]}]
    if workload in ("json", "json-schema", "json-free"):
        return [{"role": "user", "content": JSON_ASK}]
    kind, lang = workload.split("-")
    program = PROGRAMS.get(kind, "quicksort")  # so do rewrite and predicted, built on it
    turn1 = [{"role": "user", "content": TURN1.format(program=program, lang=LANGS[lang])}]
    if kind != "rewrite":
        return turn1
    answer = {"role": "assistant", "content": turn1_answer}
    return [*turn1, answer, {"role": "user", "content": TURN2}]


def edited(answer: str) -> str:
    """A predicted workload's `prediction`: the answer with identifiers renamed (EDITS)."""
    for old, new in EDITS.items():
        answer = answer.replace(old, new)
    return answer
