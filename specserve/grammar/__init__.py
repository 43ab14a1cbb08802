"""Constrained decoding on llguidance: a request's output follows a grammar (a JSON schema,
a regex, a choice, a Lark or GBNF grammar, or calls of the offered tools).

`formats.py` turns what a request asks for into one llguidance grammar, `vocab.py` adapts
our tokenizer to the library, `constraint.py` is one request's matcher as the engine uses
it: masks only where the model's own choice is not allowed, drafts cut at the first
forbidden token, and the forced tokens of a state offered as a draft. docs/grammar.md says
why llguidance.
"""
