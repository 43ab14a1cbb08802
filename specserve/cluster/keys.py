"""The router's key for a request: the prompt's token ids as the ingress renders them.

Rendered as the replica will (the chat template over the messages) but without its
checks: a body the replica refuses gets a key anyway, or [] (power of two choices).
A slightly different rendering costs only a shorter match, never a wrong answer.
"""

from __future__ import annotations

import json
from typing import Any

from specserve.loading.tokenizer import Tokenizer


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _messages(raw: list[Any]) -> list[dict[str, Any]]:
    out = []
    for m in raw:
        if isinstance(m, dict):
            out.append({**m, "content": _text(m.get("content"))})
    return out


def routing_key(tok: Tokenizer, path: str, body: bytes) -> list[int]:
    """Token ids of the prompt in an OpenAI request body; [] when there is none."""
    try:
        data = json.loads(body) if body else None
        if not isinstance(data, dict):
            return []
        if path.endswith("/chat/completions") and isinstance(data.get("messages"), list):
            return tok.chat(_messages(data["messages"]), data.get("tools"))
        prompt = data.get("prompt") if path.endswith("/completions") else data.get("input")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            if path.endswith("/responses") and tok.has_chat_template:
                return tok.chat([{"role": "user", "content": prompt}])
            return tok.encode(prompt)
        if isinstance(prompt, list):  # Responses input items
            return tok.chat(_messages(prompt))
    except Exception:  # noqa: BLE001 - a key is a hint; the replica judges the body
        return []
    return []
