"""A depth-bounded suffix trie with lazy leaves: the index behind SuffixDecoding (suffix.py).

It holds every substring of length <= depth of some token sequences as a path from the root;
a node counts its string's occurrences and keeps its most frequent child. A string seen once
is not expanded: its node remembers where its occurrence ends and its continuation is read
from the sequence; children appear when a second occurrence arrives. So unrepetitive text
costs O(1) nodes per token, and adding a token costs O(1 + the longest repeated suffix ending
at it) <= depth dict operations.

Why this structure: it is short and fast in Python. A path-compressed suffix tree (Ukkonen;
ArcticInference's) also saves memory on long repeats, but its split / merge bookkeeping is
long and hard to read; a suffix automaton adds a token in O(1), but keeping occurrence counts
needs an unbounded walk up its suffix links per token.
"""

from __future__ import annotations

from collections.abc import Sequence

_STALE = -2  # `best` after the best child lost an occurrence: recomputed when next needed


class TrieNode:
    """A string in the trie.

    count: its occurrences; out: those followed by a token (= sum of the children's counts);
    children: token -> node, None while count == 1 (the continuation is then read from seq);
    best: the token of the child with most occurrences, then the latest (-1: none);
    seq, pos, stamp: where its latest occurrence ends (its last token is seq[pos]) and when
        that token was added (tokens are numbered in the order they are added to the trie);
    link: the node of the string without its first token (None until `append` meets it).
    """

    __slots__ = ("best", "children", "count", "link", "out", "pos", "seq", "stamp")

    def __init__(self, seq: list[int], pos: int, stamp: int) -> None:
        self.count, self.out, self.best = 1, 0, -1
        self.children: dict[int, TrieNode] | None = None
        self.seq, self.pos, self.stamp = seq, pos, stamp
        self.link: TrieNode | None = None


# a place in the trie: a node and how many tokens further along its single occurrence
# (non-zero only past a count-1 node, whose continuation is not expanded)
Cursor = tuple[TrieNode, int]


class SuffixTrie:
    """Every substring of length <= depth of some token sequences, with occurrence counts.

    Tokens are added one by one (`append`), each sequence keeping its *loci*: the expanded
    nodes of the suffixes ending at its last token that occurred before, lengths 1..K. They
    are the parents of the next token's suffixes, so adding a token costs O(K + 1). Whole
    sequences can be added (`add`) and removed again, oldest first (`remove`).

    Example: 1 was followed by 2, then by 3 (equally often: the latest wins).

    >>> trie = SuffixTrie(depth=3)
    >>> trie.add([1, 2, 1, 3])
    >>> trie.next_token(trie.locate([1]))
    (3, 0.5)
    >>> trie.match([5, 2, 1], max_len=2)[1]  # [2, 1] occurred, and 3 followed it
    2
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = TrieNode([], -1, -1)
        self.root.count, self.root.children = 0, {}
        self.n_added = 0  # tokens added so far: the next token's stamp

    def append(self, seq: list[int], i: int, loci: list[TrieNode]) -> list[TrieNode]:
        """Add seq[i] (seq[:i] was added, and has `loci`); returns the loci of seq[:i + 1].

        The suffix of length k ending at i extends the suffix of length k - 1 ending at i - 1,
        for k = 1 .. K + 1. Longer ones extend a string seen once: they are new, and stay
        implicit below the (count-1) node of length K + 1.
        """
        token, stamp = seq[i], self.n_added
        self.n_added += 1
        new_loci = []
        shorter = self.root  # the node of the suffix one token shorter, ending at i
        for k in range(min(len(loci) + 1, self.depth)):
            parent = loci[k - 1] if k else self.root
            children = parent.children
            assert children is not None  # loci are expanded
            child = children.get(token)
            if child is None:
                child = children[token] = TrieNode(seq, i, stamp)
            else:
                if child.children is None:  # its second occurrence: expand the first one
                    self._expand(child, k + 1)
                child.count += 1
                child.seq, child.pos, child.stamp = seq, i, stamp
                new_loci.append(child)  # seen twice now: a locus (repeats form a prefix)
            parent.out += 1
            if parent.best == _STALE:
                self._refresh(parent)
            if parent.best < 0 or child.count >= children[parent.best].count:
                parent.best = token  # ties: the latest occurrence, this one
            child.link, shorter = shorter, child
        return new_loci

    def _expand(self, node: TrieNode, length: int) -> None:
        """Give a count-1 node of `length` tokens the child its single occurrence continues with."""
        node.children = {}
        nxt = node.pos + 1
        if length < self.depth and nxt < len(node.seq):
            node.children[node.seq[nxt]] = TrieNode(node.seq, nxt, node.stamp + 1)
            node.out, node.best = 1, node.seq[nxt]

    def _refresh(self, node: TrieNode) -> None:
        """Recompute a stale `best`: most occurrences, then latest."""
        children = node.children or {}
        node.best = max(children, key=lambda t: (children[t].count, children[t].stamp), default=-1)

    def add(self, seq: list[int]) -> None:
        """Add a whole sequence (it must not change afterwards)."""
        loci: list[TrieNode] = []
        for i in range(len(seq)):
            loci = self.append(seq, i, loci)

    def remove(self, seq: list[int]) -> None:
        """Remove the oldest sequence still in the trie (added with `add`).

        Each of its substrings loses an occurrence; nodes left with none are deleted. Oldest
        first keeps the other nodes' `seq, pos, stamp` valid: a node whose latest occurrence
        is in the oldest sequence has all of them there.
        """
        for j in range(len(seq)):
            node = self.root
            for q in range(j, min(j + self.depth, len(seq))):
                children = node.children
                assert children is not None  # the string occurs here and in the path: expanded
                token = seq[q]
                child = children[token]
                node.out -= 1
                child.count -= 1
                if node.best == token:
                    node.best = _STALE
                if child.count == 0:  # its subtree held only this occurrence
                    del children[token]
                    break
                node = child

    def next_token(self, cursor: Cursor) -> tuple[int, float] | None:
        """The most frequent token after the cursor's string and its share; None if none."""
        node, off = cursor
        if node.children is None:  # seen once: read its continuation
            nxt = node.pos + 1 + off
            return (node.seq[nxt], 1.0) if nxt < len(node.seq) else None
        if node.best == _STALE:
            self._refresh(node)
        if node.best < 0:
            return None
        return node.best, node.children[node.best].count / node.out

    def step(self, cursor: Cursor, token: int) -> Cursor | None:
        """The place of the cursor's string + token; None if that never occurred."""
        node, off = cursor
        if node.children is None:
            nxt = node.pos + 1 + off
            ok = nxt < len(node.seq) and node.seq[nxt] == token
            return (node, off + 1) if ok else None
        child = node.children.get(token)
        return None if child is None else (child, 0)

    def locate(self, tokens: Sequence[int]) -> Cursor | None:
        """The place of a string (at most `depth` tokens); None if it never occurred.

        `step` inlined: this walk is most of the cost of a global match.
        """
        node, off = self.root, 0
        for token in tokens:
            children = node.children
            if children is None:
                nxt = node.pos + 1 + off
                if nxt >= len(node.seq) or node.seq[nxt] != token:
                    return None
                off += 1
            else:
                child = children.get(token)
                if child is None:
                    return None
                node = child
        return node, off

    def match(self, tokens: Sequence[int], max_len: int) -> tuple[Cursor, int] | None:
        """The longest suffix of tokens (<= max_len) that some token follows, and its length.

        Being followed is monotone in the length (so is every suffix of a followed string):
        the longest is tried first (it usually is the one when a draft drops its oldest
        token), then a binary search.
        """

        def followed(n: int) -> Cursor | None:
            cursor = self.locate(tokens[len(tokens) - n :])
            return cursor if cursor is not None and self.next_token(cursor) else None

        lo, hi = 1, min(max_len, len(tokens))
        found = followed(hi) if hi >= 1 else None
        if found is not None:
            return found, hi
        best = None
        hi -= 1
        while lo <= hi:
            mid = (lo + hi) // 2
            cursor = followed(mid)
            if cursor is None:
                hi = mid - 1
            else:
                best, lo = (cursor, mid), mid + 1
        return best
