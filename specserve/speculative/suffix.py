"""SuffixDecoding: draft the most frequent continuation of the context's longest repeated suffix.

After Oliaro et al., "SuffixDecoding" (arXiv 2411.04975) and the linear speculation of its
vLLM / ArcticInference implementation. Two indexes of token sequences:
- a request tree over the slot's own context (prompt + emitted tokens), grown every step;
- a global tree over the outputs of earlier requests of the same tenant (speculative/tenants.py),
  fed when a slot is reset, shared by all slots and bounded (`max_global_tokens`).

Drafting, per slot and step, in each tree:
1. pattern: the longest suffix of the context, p <= max_depth tokens, that occurs in the
   tree followed by some token;
2. follow the most frequent continuation, token by token. A drafted token's probability
   estimate is the product of the ratios count(child) / count(followed occurrences) on the
   way; stop below min_token_prob, at n_max, or at the paper's adaptive bound
   MAX_SPEC = alpha * p tokens (vLLM's max_spec_factor). When the current string outgrows
   max_depth, or nothing follows it, the draft goes on from the longest shorter suffix of
   context + draft that is followed (old tokens are dropped; none left: stop);
3. score = the sum of the drafted tokens' probabilities (the paper's SCORE: the expected
   number of accepted tokens if the estimates hold). The request tree's draft is taken
   unless the global tree's scores higher.

Both trees are `SuffixTrie`s (suffix_trie.py): depth-bounded suffix tries of depth
max_depth + 1 with lazy leaves, chosen as the simplest structure that is fast in Python.

Cost per step: adding the new tokens (above); the request tree's pattern is free (the
repeated suffixes ending at the newest token are known from adding it), the global tree's is
a binary search over p (O(max_depth log max_depth)); a drafted token costs O(1), or one
re-match (usually one walk of max_depth tokens) where old tokens are dropped.

Differences from the paper and ArcticInference: linear drafts (no speculation trees); only
the longest pattern (ArcticInference tries every length and keeps the best score); ratios
are over occurrences that are followed (ArcticInference counts all, so the context's own
newest occurrence always lowers the first ratio); drafts go on past max_depth by dropping old
tokens (ArcticInference stops at the tree's depth); the global tree learns an output when its
slot is reset, not token by token, and is bounded in tokens, not requests (the oldest
outputs are removed: O(max_depth) per token); among equally frequent continuations the one
seen last is followed.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence

from specserve.speculative.base import Draft, DraftRequest, Speculator
from specserve.speculative.ngram import check_positive
from specserve.speculative.suffix_trie import Cursor, SuffixTrie
from specserve.speculative.tenants import PerTenant

_EPS = 1e-6  # alpha * p is floored; keep 0.1 * 30 = 3, not 2.9999
# a draft's tier (Draft.tier: acceptance is learnt per tier) is the length of the match it
# started from, up to this, and which tree it came from: on the `bench serve` prompts the
# first token was kept more often the longer the match, and less often from the global tree
# than from the request's own (figures: docs/perf/cost.md)
TIER_DEPTH = 6


def _tier(p: int, from_global: bool) -> int:
    return 2 * min(p, TIER_DEPTH) + int(from_global)


def _max_spec(alpha: float, p: int) -> int:
    """The paper's adaptive draft bound MAX_SPEC = alpha * p, floored."""
    return int(alpha * p + _EPS)


# readable reference -----------------------------------------------------------------------


def _followers(seqs: Sequence[Sequence[int]], pattern: list[int]) -> dict[int, tuple[int, int]]:
    """token -> (times it followed `pattern` in seqs, order of the latest such occurrence)."""
    n, order = len(pattern), 0
    stats: dict[int, tuple[int, int]] = {}
    for seq in seqs:
        for q in range(n, len(seq)):
            if list(seq[q - n : q]) == pattern:
                stats[seq[q]] = (stats.get(seq[q], (0, 0))[0] + 1, order)
            order += 1
    return stats


def _reference_follow(
    seqs: Sequence[Sequence[int]], context: Sequence[int], n_max: int, max_depth: int,
    alpha: float, min_token_prob: float,
) -> tuple[list[int], float]:  # fmt: skip
    """One tree's draft and score, by counting in the sequences directly (module docstring)."""
    window = list(context)

    def longest(max_len: int) -> int:
        lengths = range(min(max_len, len(window)), 0, -1)
        return next((n for n in lengths if _followers(seqs, window[-n:])), 0)

    length = longest(max_depth)
    limit = min(n_max, _max_spec(alpha, length))
    draft: list[int] = []
    score, prob = 0.0, 1.0
    while len(draft) < limit:
        stats = _followers(seqs, window[-length:]) if length <= max_depth else {}
        if not stats:
            length = longest(min(length - 1, max_depth))
            if length == 0:
                break
            stats = _followers(seqs, window[-length:])
        token = max(stats, key=stats.__getitem__)  # most frequent, then latest
        prob *= stats[token][0] / sum(count for count, _ in stats.values())
        if prob < min_token_prob:
            break
        draft.append(token)
        window.append(token)
        score, length = score + prob, length + 1
    return draft, score


def suffix_draft(
    context: Sequence[int],
    outputs: Sequence[Sequence[int]],
    n_max: int,
    max_depth: int = 24,
    alpha: float = 1.0,
    min_token_prob: float = 0.1,
) -> list[int]:
    """SuffixDecoding's draft, by brute force: the reference `SuffixSpeculator` must equal.

    context: [L] the slot's tokens, newest last (its own tree); outputs: earlier requests'
    outputs (the global tree). Each gives a draft and a score; the global one is taken only
    if it scores higher. Cost O(L * max_depth) per drafted token: for tests and examples.

    Example: the suffix [1, 2, 3] (p = 3, so at most 3 tokens) was followed by 4, then by 5:
    5 is as frequent and later, with probability 1/2; what followed it then is certain. An
    earlier output followed [1, 2, 3] by 4, 6, 6 only: score 3 beats 0.5 * 3.

    >>> context = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    >>> suffix_draft(context, [], n_max=8)
    [5, 1, 2]
    >>> suffix_draft(context, [], n_max=8, min_token_prob=0.6)
    []
    >>> suffix_draft(context, [[1, 2, 3, 4, 6, 6]], n_max=8)
    [4, 6, 6]
    """
    args = (n_max, max_depth, alpha, min_token_prob)
    local, local_score = _reference_follow([context], context, *args)
    best, best_score = _reference_follow(outputs, context, *args)
    return best if best_score > local_score else local


# the speculator -----------------------------------------------------------------------------


class _Request:
    """A slot's context, the trie over it, its loci, and where its output starts."""

    def __init__(self, depth: int, prompt_len: int) -> None:
        self.tokens: list[int] = []
        self.trie = SuffixTrie(depth)
        self.loci: list[int] = []  # trie nodes
        self.prompt_len = prompt_len

    def extends(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` continue this context (only the last old token is compared)."""
        n_old = len(self.tokens)
        return len(tokens) >= n_old and (n_old == 0 or tokens[n_old - 1] == self.tokens[-1])

    def sync(self, tokens: Sequence[int]) -> None:
        """Add the tokens past the old context (which `tokens` must extend) to the trie."""
        for i in range(len(self.tokens), len(tokens)):
            self.tokens.append(int(tokens[i]))
            self.loci = self.trie.append(self.tokens, i, self.loci)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class _GlobalTree:
    """One tenant's earlier outputs, as a trie, oldest first, at most `cap` tokens."""

    def __init__(self, depth: int, cap: int) -> None:
        self.trie = SuffixTrie(depth)
        self.cap = cap
        self.outputs: deque[array[int]] = deque()  # 4 bytes a token, not a list's ~40
        self.tokens = 0

    def learn(self, output: Sequence[int]) -> None:
        seq = array("i", output[max(0, len(output) - self.cap) :]) if self.cap else array("i")
        if not seq:
            return
        while self.tokens + len(seq) > self.cap:  # forget the oldest outputs
            old = self.outputs.popleft()
            self.tokens -= len(old)
            self.trie.remove(old)
        self.outputs.append(seq)
        self.tokens += len(seq)
        self.trie.add(seq)


class SuffixSpeculator(Speculator):
    """`suffix`: SuffixDecoding over each slot's context and the outputs of earlier requests.

    max_depth: longest pattern matched [vLLM: suffix_decoding_max_tree_depth, 24];
    alpha: at most alpha * p tokens are drafted after a p-token match (the paper's
        MAX_SPEC = alpha * p) [vLLM: suffix_decoding_max_spec_factor, 1.0];
    min_token_prob: a draft stops before a token whose probability estimate is below this
        [vLLM: suffix_decoding_min_token_prob, 0.1];
    max_global_tokens: most output tokens the global tree holds (0: no global tree); the
        oldest outputs are removed to make room [128 Ki: ~15-135 MB; ~0.12 kB a token of text
        seen once, ~1 kB of text seen twice or more, which expands into ~max_depth nodes].
    """

    name = "suffix"

    def __init__(
        self,
        max_depth: int = 24,
        alpha: float = 1.0,
        min_token_prob: float = 0.1,
        max_global_tokens: int = 1 << 17,
    ) -> None:
        super().__init__()
        check_positive(max_depth=max_depth)
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha!r}")
        if not 0 <= min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob!r}")
        if isinstance(max_global_tokens, bool) or not isinstance(max_global_tokens, int):
            raise ValueError(f"max_global_tokens must be an integer, got {max_global_tokens!r}")
        if max_global_tokens < 0:
            raise ValueError(f"max_global_tokens must be >= 0, got {max_global_tokens}")
        self.max_depth, self.alpha, self.min_token_prob = max_depth, alpha, min_token_prob
        self.max_global_tokens = max_global_tokens
        self._depth = max_depth + 1  # a pattern and the token that follows it
        self._global = PerTenant(lambda: _GlobalTree(self._depth, max_global_tokens))
        self._requests: dict[int, _Request] = {}

    @property
    def global_tokens(self) -> int:
        """Output tokens in the default tenant's global tree."""
        return self._global[None].tokens

    def learn(self, output: Sequence[int], tenant: str | None = None) -> bool:
        """Add an output to the tenant's global tree (done at reset; public to warm the
        tree up, or to share what other replicas generated)."""
        if self.max_global_tokens == 0:
            return False
        self._global[tenant].learn(output)
        return True

    def _begin(self, slot: int, prompt: Sequence[int]) -> None:
        self._finish(slot)  # a slot reused without reset() finished its previous sequence
        request = self._requests[slot] = _Request(self._depth, len(prompt))
        request.sync(prompt)  # index the prompt now, not in the first step

    def _reset(self, slot: int) -> None:
        self._finish(slot)

    def _finish(self, slot: int) -> None:
        request = self._requests.pop(slot, None)
        if request is not None:
            self.learn(request.output, self.tenant(slot))

    def _draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for req in requests:
            request = self._requests.get(req.slot)
            if request is None or not request.extends(req.tokens):
                self._finish(req.slot)  # a new sequence without begin(): all of it is prompt
                request = self._requests[req.slot] = _Request(self._depth, len(req.tokens))
            request.sync(req.tokens)
            drafts.append(self._draft_one(request, req.n_max, self._global[self.tenant(req.slot)]))
        return drafts

    def _draft_one(self, request: _Request, n_max: int, earlier: _GlobalTree) -> Draft:
        """The request tree's draft, or the global tree's if that scores higher."""
        window = request.tokens[max(0, len(request.tokens) - self.max_depth) :]
        best = Draft()
        best_score = 0.0
        p = min(len(request.loci), self.max_depth)  # repeated suffixes ending at the newest
        if p:
            cursor = (request.loci[p - 1], 0)
            tokens, best_score = self._follow(request.trie, cursor, p, list(window), n_max)
            best = Draft(tokens, tier=_tier(p, False))
        # a draft's score is at most its length: skip the global tree when it cannot win
        if not earlier.tokens or best_score >= min(n_max, _max_spec(self.alpha, self.max_depth)):
            return best
        found = earlier.trie.match(window, self.max_depth)
        if found is not None and min(n_max, _max_spec(self.alpha, found[1])) > best_score:
            tokens, score = self._follow(earlier.trie, *found, list(window), n_max)
            if score > best_score:
                best = Draft(tokens, tier=_tier(found[1], True))
        return best

    def _follow(
        self, trie: SuffixTrie, cursor: Cursor, p: int, window: list[int], n_max: int
    ) -> tuple[list[int], float]:
        """Draft from a p-token match at `cursor`; returns the draft and its score.

        window: the context's last tokens; the draft is appended to it, for re-matching.
        """
        draft: list[int] = []
        score, prob, length = 0.0, 1.0, p
        limit = min(n_max, _max_spec(self.alpha, p))
        while len(draft) < limit:
            step = trie.next_token(cursor) if length <= self.max_depth else None
            node, off = cursor
            if step is None and off == 0 and length > 1 and trie.link[node] >= 0:
                # drop the oldest token
                cursor, length = (trie.link[node], 0), length - 1
                step = trie.next_token(cursor)
            if step is None:  # drop more: the longest shorter suffix that is followed
                found = trie.match(window, min(length - 1, self.max_depth))
                if found is None:
                    break
                cursor, length = found
                step = trie.next_token(cursor)
                assert step is not None  # match() returns followed strings
            token, ratio = step
            prob *= ratio
            if prob < self.min_token_prob:
                break
            draft.append(token)
            window.append(token)
            score, length = score + prob, length + 1
            after = trie.step(cursor, token)
            assert after is not None  # the token was read from the trie
            cursor = after
        return draft, score
