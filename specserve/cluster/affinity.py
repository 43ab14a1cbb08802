"""Which replica a request goes to: token-prefix affinity, bounded by load (no Ray here).

The router keeps, per replica, an approximate prefix tree of the prompts it sent there
(sgl-router's and Ray's PrefixCacheAffinityRouter's idea, on token ids rather than
characters, so a match is a match of what a replica's prompt cache holds):

    affine  = the replica whose tree holds the longest prefix of this prompt
    least   = the least loaded replica (of equals, the one holding more of the prompt)
    go to affine       when it holds >= min_match tokens more than least does and its
                       queue is at most `threshold` requests longer than least's
    go to least        when affine is over that threshold, or holds little more than least
                       (a system prompt every replica has seen is no reason to queue)
    power of two       when no replica holds enough of the prompt (None: the caller's)

"Approximate": the tree records what was routed, not what a replica still caches (its
slots may have moved on); each replica's tree is capped and forgets its oldest prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

# one stored prompt per key: the first tokens of a prompt are enough to tell conversations
# apart, and a follow-up turn extends its previous prompt
MAX_PROMPT_TOKENS = 8192
K = TypeVar("K", bound=Hashable)  # a replica's id


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0  # stored prompts passing through this node


class ReplicaTree:
    """The prompts routed to one replica, as a token trie with an LRU cap on prompts."""

    def __init__(self, max_prompts: int = 1024) -> None:
        self.root = _Node()
        self.max_prompts = max_prompts
        self._prompts: OrderedDict[tuple[int, ...], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._prompts)

    def insert(self, tokens: Sequence[int]) -> None:
        key = tuple(tokens[:MAX_PROMPT_TOKENS])
        if not key:
            return
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return
        self._prompts[key] = None
        node = self.root
        for t in key:
            node = node.children.setdefault(t, _Node())
            node.count += 1
        while len(self._prompts) > self.max_prompts:
            self._remove(self._prompts.popitem(last=False)[0])

    def _remove(self, key: tuple[int, ...]) -> None:
        node = self.root
        for t in key:
            child = node.children[t]
            child.count -= 1
            if child.count == 0:
                del node.children[t]  # the rest of the path belonged to this prompt alone
                return
            node = child

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` some routed prompt shares."""
        node, n = self.root, 0
        for t in tokens[:MAX_PROMPT_TOKENS]:
            child = node.children.get(t)
            if child is None:
                break
            node, n = child, n + 1
        return n


@dataclass
class Choice(Generic[K]):
    replica: K
    reason: str  # "affinity", "least-loaded" (affine one overloaded)
    matched: int  # tokens of the prompt the affine replica holds


class PrefixRouter(Generic[K]):
    """Per-replica prefix trees and the choice rule in the module docstring."""

    def __init__(self, threshold: int = 4, min_match: int = 16, max_prompts: int = 1024):
        if threshold < 0 or min_match < 1:
            raise ValueError("threshold must be >= 0 and min_match >= 1")
        self.threshold = threshold
        self.min_match = min_match
        self.max_prompts = max_prompts
        self.trees: dict[K, ReplicaTree] = {}

    def routed(self, replica: K, tokens: Sequence[int]) -> None:
        """A prompt went to `replica`: its cache will hold it."""
        tree = self.trees.get(replica)
        if tree is None:
            tree = self.trees[replica] = ReplicaTree(self.max_prompts)
        tree.insert(tokens)

    def forget(self, replica: K) -> None:
        """The replica died or was removed: what it cached is gone."""
        self.trees.pop(replica, None)

    def matches(self, tokens: Sequence[int], candidates: Sequence[K]) -> dict[K, int]:
        """Per candidate, how many leading tokens of the prompt its tree holds."""
        trees = self.trees
        return {r: trees[r].match(tokens) if r in trees else 0 for r in candidates}

    def choose(self, tokens: Sequence[int], queues: Mapping[K, int]) -> Choice[K] | None:
        """The replica for a prompt given each candidate's queue length (ongoing requests);
        None when no candidate holds min_match tokens of it (power of two choices then)."""
        held = self.matches(tokens, list(queues))
        affine = max(queues, key=lambda r: (held[r], -queues[r]))
        if held[affine] < self.min_match:
            return None
        least = min(queues, key=lambda r: (queues[r], -held[r]))
        overloaded = queues[affine] - queues[least] > self.threshold
        if overloaded or held[affine] - held[least] < self.min_match:
            return Choice(least, "least-loaded", held[least])
        return Choice(affine, "affinity", held[affine])
