"""A byte-level recognizer of one JSON object (RFC 8259), for OpenAI's JSON mode.

`step(state, byte)` is the next state, or None when no JSON object continues that way;
`done(state)` says whether the object is complete. A state is an immutable tuple
(mode, stack, aux), so a verification row can advance its own copy along the draft.
Bytes >= 0x80 are accepted inside strings only (the UTF-8 of any character; a token may
hold part of one), as RFC 8259 allows any character there but no control byte.

The object starts at once (no whitespace before it) and nothing follows it; between
tokens at most MAX_WHITESPACE whitespace bytes come in a row.

Modes: TOP (before the object), VALUE, KEY_OR_END (after "{"), KEY (after "," in an
object), COLON, VALUE_OR_END (after "["), AFTER (after a value: "," or a closer), STRING
(aux: whether it is a key), ESCAPE, UNICODE (aux: hex digits left), NUMBER (aux: which
part of -?int(.frac)?([eE][+-]?exp)? it is in), LITERAL (aux: the bytes still due), DONE.
"""

from __future__ import annotations

from typing import Any

State = tuple[str, tuple[str, ...], Any]

START: State = ("TOP", (), None)
MAX_WHITESPACE = 24  # bytes of whitespace in a row (indentation of pretty-printed JSON fits)
_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
# number parts that may end the number, and the byte -> next part moves of each part
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})
_NUMBER_MOVES: dict[str, list[tuple[frozenset[int], str]]] = {
    "minus": [(frozenset(b"0"), "zero"), (frozenset(b"123456789"), "int")],
    "zero": [(frozenset(b"."), "dot"), (frozenset(b"eE"), "e")],
    "int": [(_DIGITS, "int"), (frozenset(b"."), "dot"), (frozenset(b"eE"), "e")],
    "dot": [(_DIGITS, "frac")],
    "frac": [(_DIGITS, "frac"), (frozenset(b"eE"), "e")],
    "e": [(frozenset(b"+-"), "sign"), (_DIGITS, "exp")],
    "sign": [(_DIGITS, "exp")],
    "exp": [(_DIGITS, "exp")],
}


def done(state: State) -> bool:
    return state[0] == "DONE"


def advance(state: State | None, data: bytes) -> State | None:
    """The state after `data`, or None if no JSON object continues that way."""
    for byte in data:
        if state is None:
            return None
        state = step(state, byte)
    return state


def step(state: State, byte: int) -> State | None:
    mode, stack, aux = state
    if mode == "STRING":
        return _in_string(stack, aux, byte)
    if mode == "ESCAPE":
        if byte == ord("u"):
            return ("UNICODE", stack, (aux, 4))
        return ("STRING", stack, aux) if byte in _ESCAPES else None
    if mode == "UNICODE":
        is_key, left = aux
        if byte not in _HEX:
            return None
        return ("STRING", stack, is_key) if left == 1 else ("UNICODE", stack, (is_key, left - 1))
    if mode == "NUMBER":
        for allowed, part in _NUMBER_MOVES[aux]:
            if byte in allowed:
                return ("NUMBER", stack, part)
        # the number ended: this byte is what follows a value
        return step(_after_value(stack), byte) if aux in _NUMBER_ENDS else None
    if mode == "LITERAL":
        if byte != aux[0]:
            return None
        return ("LITERAL", stack, aux[1:]) if len(aux) > 1 else _after_value(stack)
    if byte in _WS:
        # aux of a structural mode counts the whitespace in a row: a model that prefers
        # whitespace to the next token would otherwise fill max_tokens with it
        run = (aux or 0) + 1
        return None if mode in ("TOP", "DONE") or run > MAX_WHITESPACE else (mode, stack, run)
    return _structural(mode, stack, byte)


def _in_string(stack: tuple[str, ...], is_key: bool, byte: int) -> State | None:
    if byte == ord('"'):
        return ("COLON", stack, None) if is_key else _after_value(stack)
    if byte == ord("\\"):
        return ("ESCAPE", stack, is_key)
    return None if byte < 0x20 else ("STRING", stack, is_key)


def _after_value(stack: tuple[str, ...]) -> State:
    return ("AFTER", stack, None) if stack else ("DONE", (), None)


def _structural(mode: str, stack: tuple[str, ...], byte: int) -> State | None:
    """A byte that is not whitespace, outside strings, numbers and literals."""
    if mode == "TOP":  # JSON mode's answer is an object
        return ("KEY_OR_END", ("{",), None) if byte == ord("{") else None
    if mode in ("KEY_OR_END", "KEY"):
        if byte == ord('"'):
            return ("STRING", stack, True)
        return _after_value(stack[:-1]) if mode == "KEY_OR_END" and byte == ord("}") else None
    if mode == "COLON":
        return ("VALUE", stack, None) if byte == ord(":") else None
    if mode == "AFTER":
        if byte == ord(","):
            return ("KEY", stack, None) if stack[-1] == "{" else ("VALUE", stack, None)
        closer = "}" if stack[-1] == "{" else "]"
        return _after_value(stack[:-1]) if byte == ord(closer) else None
    if mode in ("VALUE", "VALUE_OR_END"):
        if mode == "VALUE_OR_END" and byte == ord("]"):
            return _after_value(stack[:-1])
        return _value(stack, byte)
    return None  # DONE: nothing follows the object


def _value(stack: tuple[str, ...], byte: int) -> State | None:
    if byte == ord("{"):
        return ("KEY_OR_END", (*stack, "{"), None)
    if byte == ord("["):
        return ("VALUE_OR_END", (*stack, "["), None)
    if byte == ord('"'):
        return ("STRING", stack, False)
    if byte in _LITERALS:
        return ("LITERAL", stack, _LITERALS[byte])
    if byte == ord("-"):
        return ("NUMBER", stack, "minus")
    if byte == ord("0"):
        return ("NUMBER", stack, "zero")
    if byte in _DIGITS:
        return ("NUMBER", stack, "int")
    return None
