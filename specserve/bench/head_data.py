"""The text `train-head` learns from: the model's own greedy answers to asks made here
(self-distillation), cached beside the heads and held out by their prompt's hash, and the
Python standard library's source cut into training pieces."""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from collections.abc import Callable
from pathlib import Path

from specserve.engine.request import Request
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import SamplingParams
from specserve.errors import SpecserveError
from specserve.loading.eagle3 import model_stem
from specserve.loading.model import LoadedModel
from specserve.loading.sources import cache_dir

TOPICS = ["a linked list", "binary search", "a JSON parser", "an LRU cache", "CSV files",
          "dates and time zones", "a web server", "unit tests", "regular expressions",
          "sorting algorithms", "a command-line tool", "recursion", "file paths",
          "a priority queue", "HTTP requests", "string formatting", "a tokenizer",
          "matrix multiplication", "async code", "error handling"]  # fmt: skip
ASKS = ["Write a Python function for {}.", "Explain {} to a beginner.",
        "Write a short docstring and type hints for code about {}.",
        "What are common mistakes with {}?", "Write a test for {} with pytest."]  # fmt: skip
# a head trained on Python alone kept far fewer of a C answer's tokens than of Python ones
# (docs/perf/2026-11-27-eagle3-int8.md): other languages and prose too. Python programs are a
# kind of their own: ASKS are mostly explanations, and a head trained without them kept far
# fewer of a Python answer's tokens than of a C one's (docs/perf/2026-11-28-eagle3-python.md)
LANGUAGES = ["C", "C++", "Java", "JavaScript", "TypeScript", "Go", "Rust", "C#", "Bash", "SQL"]
CODE_ASKS = ["Write a {lang} function for {topic}.", "Write a small {lang} program about {topic}.",
             "Explain {topic} with a short {lang} example."]  # fmt: skip
PROSE_TOPICS = ["a city at night", "learning to cook", "a long train journey", "the ocean",
                "a lost letter", "a first day at work", "autumn in the mountains", "bees",
                "a robot that paints", "a small bakery", "a rainy afternoon", "an old library",
                "the history of tea", "a chess tournament", "moving to a new country",
                "a garden", "the moon landing", "a thunderstorm", "friendship",
                "a museum"]  # fmt: skip
PROSE_ASKS = ["Write a short story about {}.", "Write a paragraph describing {}.",
              "Write a short essay about {}.", "Write a letter to a friend about {}.",
              "Write a poem about {}."]  # fmt: skip


HELD_OUT = 64  # most held-out sequences: each costs a target forward at the end
HELD_OUT_SHARE = 16  # one answer in this many is never trained on
# a cap on tokenizing time at the start, below what the top-level modules hold; a run given
# more (--stdlib-tokens) taught the 0.5B's head no more (docs/perf/2026-11-29-head-kernel.md)
STDLIB_TOKENS = 400_000


def asks(n: int, seed: int) -> list[str]:
    """n prompts, taken in turn from four kinds so that the head sees more than one
    language's code: each ask about each topic in Python (the standard library's modules
    among them), programs in Python, code in other languages, and prose."""
    topics = python_topics()
    kinds = [
        [a.format(t) for t in topics for a in ASKS],
        code_asks(["Python"], topics),
        code_asks(LANGUAGES),
        [a.format(t) for t in PROSE_TOPICS for a in PROSE_ASKS],
    ]
    for i, kind in enumerate(kinds):
        random.Random(seed + i).shuffle(kind)
    mixed = [k[j] for j in range(max(map(len, kinds))) for k in kinds if j < len(k)]
    return list(dict.fromkeys(mixed))[:n]  # "Write a Python function for ..." is in two kinds


def python_topics() -> list[str]:
    """TOPICS and each of the standard library's modules."""
    modules = sorted(p.stem for p in Path(sysconfig.get_paths()["stdlib"]).glob("[a-z]*.py"))
    return TOPICS + [f"Python's {m} module" for m in modules]


def code_asks(languages: list[str], topics: list[str] | None = None) -> list[str]:
    """Each code ask about each topic (TOPICS by default) in each of these languages."""
    return [
        a.format(lang=g, topic=t) for t in topics or TOPICS for g in languages for a in CODE_ASKS
    ]


def cached_answers(
    loaded: LoadedModel, model: str, n: int, max_tokens: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """`answers`, kept in the cache beside the heads: a resumed or repeated run with the same
    model, count, length and seed reads them back instead of decoding them again, and any run
    decodes only the prompts no cached file of this model and length answered (a greedy reply
    to the same prompt ids is the same text, whatever ask set or seed it came in). Each
    reply ends at the model's end of turn, as a served one does; files written before
    replies stopped there are cut on reading (`until_stop`). A reply a file of a shorter
    max_tokens holds is read back whole where it ended at its end of turn, and decoded on
    from where that file's cap cut it otherwise (`_continued`)."""
    questions = asks(n, seed)
    path = _answers_path(model, questions, max_tokens, seed)
    stop = loaded.tokenizer.eog_ids if loaded.tokenizer is not None else frozenset()
    if path.exists():
        return [(p, until_stop(r, stop)) for p, r in json.loads(path.read_text())]
    prompts = [chat_prompt(loaded, q) for q in questions]
    known = _known_answers(model, max_tokens)
    cut = _shorter_answers(model, max_tokens, stop, known)
    known.update(_continued(loaded, [(p, cut[tuple(p)]) for p in prompts if tuple(p) in cut],
                            max_tokens, stop))  # fmt: skip
    missing = [p for p in prompts if tuple(p) not in known]
    if missing:
        made = answers(loaded, missing, max_tokens, stop_ids=stop)
        known.update((tuple(p), r) for p, r in made)
    replies = [(p, until_stop(known[tuple(p)], stop)) for p in prompts]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, lambda tmp: tmp.write_text(json.dumps(replies)))
    return replies


def until_stop(reply: list[int], stop_ids: frozenset[int]) -> list[int]:
    """The reply up to its first stop id, included: past it, a reply decoded on to
    max_tokens holds text a server never asks a head to draft."""
    for i, t in enumerate(reply):
        if t in stop_ids:
            return reply[: i + 1]
    return reply


def _answers_path(model: str, questions: list[str], max_tokens: int, seed: int) -> Path:
    digest = hashlib.sha256("\n".join(questions).encode()).hexdigest()[:8]
    name = f"{model_stem(model)}-{len(questions)}x{max_tokens}-{seed}-{digest}.json"
    return cache_dir() / "head-answers" / name


def _known_answers(model: str, max_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """prompt ids -> reply, from every cached file of this model and reply length."""
    known: dict[tuple[int, ...], list[int]] = {}
    for path, cap in _answer_files(model):
        if cap == max_tokens:
            known.update((tuple(p), r) for p, r in json.loads(path.read_text()))
    return known


def _shorter_answers(
    model: str, max_tokens: int, stop: frozenset[int], known: dict[tuple[int, ...], list[int]]
) -> dict[tuple[int, ...], list[int]]:
    """prompt ids -> reply, from the cached files of this model with a shorter max_tokens,
    for the prompts `known` lacks: a greedy reply is the same text whatever the cap (but for
    rounding where two tokens all but tie), so a reply that ended at its end of turn is
    whole, and one its cap cut is where a longer one starts. Each prompt's longest is kept."""
    found: dict[tuple[int, ...], list[int]] = {}
    for path, cap in _answer_files(model):
        if cap >= max_tokens:
            continue
        for p, r in json.loads(path.read_text()):
            reply = until_stop(r, stop)
            if tuple(p) not in known and len(reply) > len(found.get(tuple(p), ())):
                found[tuple(p)] = reply
    return found


def _continued(
    loaded: LoadedModel,
    cut: list[tuple[list[int], list[int]]],
    max_tokens: int,
    stop: frozenset[int],
) -> dict[tuple[int, ...], list[int]]:
    """Shorter replies (`_shorter_answers`) made up to max_tokens long: a whole one as it is,
    one its cap cut decoded on from its prompt and text (those with as many tokens left in
    one batch)."""
    done = {tuple(p): r for p, r in cut if r and r[-1] in stop}
    by_left: dict[int, list[tuple[list[int], list[int]]]] = {}
    for p, r in cut:
        if tuple(p) not in done:
            by_left.setdefault(max_tokens - len(r), []).append((p, r))
    for left, group in by_left.items():
        made = answers(loaded, [p + r for p, r in group], left, stop_ids=stop)
        done.update((tuple(p), r + more) for (p, r), (_, more) in zip(group, made, strict=True))
    return done


def _answer_files(model: str) -> list[tuple[Path, int]]:
    """Each cached answers file of this model and the max_tokens it was made with."""
    folder = cache_dir() / "head-answers"
    files = []
    for path in sorted(folder.glob(f"{model_stem(model)}-*x*-*.json")):
        shape = path.name.removeprefix(f"{model_stem(model)}-").split("-")[0]
        count, _, cap = shape.partition("x")
        if count.isdigit() and cap.isdigit():
            files.append((path, int(cap)))
    return files


def chat_prompt(loaded: LoadedModel, question: str) -> list[int]:
    """The prompt ids of one user message in the model's chat template."""
    if loaded.tokenizer is None:
        raise SpecserveError("self-distillation needs the model's tokenizer")
    return list(loaded.tokenizer.chat([{"role": "user", "content": question}]))


def split_answers(
    own: list[tuple[list[int], list[int]]],
) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
    """(held out, trained on): an answer is held out by its prompt's hash (one in
    HELD_OUT_SHARE, at most HELD_OUT // 2 measured), never by its place in the list. Held out
    by place, the answers a run measured on were ones an earlier run had trained on where its
    asks came in another order (a resumed head, a changed prompt set): a greedy answer to the
    same prompt is the same text."""
    out = [_held_out(p) for p, _ in own]
    chosen = [a for a, held in zip(own, out, strict=True) if held]
    trained = [a for a, held in zip(own, out, strict=True) if not held]
    if not chosen:  # a handful of answers, none drawn: measure on the first
        chosen, trained = own[:1], own[1:]
    return chosen[: HELD_OUT // 2], trained


def _held_out(prompt: list[int]) -> bool:
    digest = hashlib.sha256(" ".join(map(str, prompt)).encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELD_OUT_SHARE == 0


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) then one rename: a run killed mid-write leaves the last whole file."""
    tmp = path.with_suffix(".tmp")
    write(tmp)
    tmp.replace(path)


def answers(
    loaded: LoadedModel,
    prompts: list[list[int]],
    max_tokens: int,
    slots: int = 16,
    stop_ids: frozenset[int] = frozenset(),
) -> list[tuple[list[int], list[int]]]:
    """The model's own greedy replies (prompt ids, reply ids) to these prompts, each
    max_tokens long unless it says one of stop_ids (then up to that one, included)."""
    from tqdm import tqdm

    from specserve.engine.engine import Engine

    runner = ModelRunner(loaded.model, slots, max(map(len, prompts)) + max_tokens + 8)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    engine = Engine(runner)
    reqs = [Request(p, params, stop_ids=stop_ids) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    with tqdm(desc="answers", total=len(reqs), unit="answer") as bar:
        while engine.has_work():
            engine.step()
            bar.update(sum(r.finished for r in reqs) - bar.n)
    return [(r.prompt, r.output) for r in reqs]


def stdlib_chunks(loaded: LoadedModel, n_tokens: int, seq_len: int, seed: int) -> list[list[int]]:
    """About n_tokens of the standard library's Python source, in seq_len pieces."""
    tok = loaded.tokenizer
    if tok is None:
        raise SpecserveError("stdlib text needs the model's tokenizer")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    random.Random(seed).shuffle(files)
    out: list[list[int]] = []
    for f in files:
        ids = tok.encode_text(f.read_text(errors="ignore"))
        out += [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        if len(out) * seq_len >= n_tokens:
            break
    return out


def pieces(seqs: list[list[int]], seq_len: int) -> list[list[int]]:
    return [s[i : i + seq_len] for s in seqs for i in range(0, max(1, len(s) - 16), seq_len)]
