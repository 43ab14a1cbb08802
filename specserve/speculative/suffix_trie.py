"""A depth-bounded suffix trie with lazy leaves: the index behind SuffixDecoding (suffix.py).

It holds every substring of length <= depth of some token sequences as a path from the root;
a node counts its string's occurrences and keeps its most frequent child. A string seen once
is not expanded: its node remembers where its occurrence ends and its continuation is read
from the sequence; children appear when a second occurrence arrives. So unrepetitive text
costs O(1) nodes per token, and adding a token costs O(1 + the longest repeated suffix ending
at it) <= depth lookups.

Why this structure: it is short and fast in Python. A path-compressed suffix tree (Ukkonen;
ArcticInference's) also saves memory on long repeats, but its split / merge bookkeeping is
long and hard to read; a suffix automaton adds a token in O(1), but keeping occurrence counts
needs an unbounded walk up its suffix links per token.

Layout: a node is an int, the index of its fields in flat arrays, not a Python object. Text
seen twice expands into ~depth nodes a token (a 128-token output repeated: ~23 a token), so a
server's global tree reaches millions of nodes. As objects with a children dict each they
filled the heap (figures: docs/perf/memory.md) and every full garbage collection walked
them. Here a node takes ~45 bytes: the only child of a node is kept inline (most nodes of
repeated text have one), and only nodes with two or more children get a dict.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Sequence

ROOT = 0
# `kid_token` values that are not a child's token
LAZY = -2  # seen once, not expanded: the continuation is read from the sequence
LEAF = -1  # expanded, no children
MULTI = -3  # two or more children: they are in `multi[node]`
_NONE, _STALE = -1, -2  # `best` values: no child; the best child lost an occurrence

# a place in the trie: a node and how many tokens further along its single occurrence
# (non-zero only past a lazy node, whose continuation is not expanded)
Cursor = tuple[int, int]


class SuffixTrie:
    """Every substring of length <= depth of some token sequences, with occurrence counts.

    Tokens are added one by one (`append`), each sequence keeping its *loci*: the expanded
    nodes of the suffixes ending at its last token that occurred before, lengths 1..K. They
    are the parents of the next token's suffixes, so adding a token costs O(K + 1). Whole
    sequences can be added (`add`) and removed again, oldest first (`remove`).

    A node's fields (arrays indexed by node):
    count: its string's occurrences; out: those followed by a token (= its children's counts);
    token: the last token of its string (the edge from its parent);
    best: its child with most occurrences, then the latest (_NONE, or _STALE: recompute);
    seq, pos, stamp: where its latest occurrence ends (its last token is seqs[seq][pos]) and
        when that token was added (tokens are numbered in the order they are added);
    link: the node of its string without the first token (-1 until `append` meets it);
    kid_token, kid: its only child's token and node, or LAZY / LEAF / MULTI.

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
        self.count, self.out, self.token, self.best = array("i"), array("i"), array("i"), array("i")
        self.seq, self.pos, self.stamp = array("i"), array("i"), array("q")
        self.link, self.kid_token, self.kid = array("i"), array("i"), array("i")
        self._columns: tuple[array[int], ...] = (self.count, self.out, self.token, self.best)
        self._columns += (self.seq, self.pos)
        self._columns += (self.stamp, self.link, self.kid_token, self.kid)
        self.multi: dict[int, dict[int, int]] = {}  # node -> {token: child}, 2+ children
        self.seqs: dict[int, Sequence[int]] = {}  # sequence id -> tokens (a list or an array)
        self._order: deque[int] = deque()  # sequence ids, oldest first
        self._last: tuple[Sequence[int], int] | None = None  # the sequence appended to last, id
        self._free: list[int] = []  # node ids freed by `remove`
        self.n_added = 0  # tokens added so far: the next token's stamp
        root = self._new(-1, -1, -1, -1)
        self.count[root], self.kid_token[root] = 0, LEAF

    # nodes ------------------------------------------------------------------------------------

    def _new(self, seq: int, pos: int, stamp: int, token: int) -> int:
        """A node of count 1, not expanded, whose occurrence ends at seqs[seq][pos]."""
        if self._free:
            node = self._free.pop()
            self.count[node], self.out[node], self.token[node], self.best[node] = 1, 0, token, _NONE
            self.seq[node], self.pos[node], self.stamp[node] = seq, pos, stamp
            self.link[node], self.kid_token[node] = -1, LAZY
            return node
        # one append per array, spelled out: this runs for every new node
        self.count.append(1)
        self.out.append(0)
        self.token.append(token)
        self.best.append(_NONE)
        self.seq.append(seq)
        self.pos.append(pos)
        self.stamp.append(stamp)
        self.link.append(-1)
        self.kid_token.append(LAZY)
        self.kid.append(0)
        return len(self.count) - 1

    def child(self, node: int, token: int) -> int:
        """The child of `node` by `token`; -1 if none."""
        kid_token = self.kid_token[node]
        if kid_token >= 0:  # (markers are negative; so may a caller's tokens be)
            return self.kid[node] if kid_token == token else -1
        if kid_token == MULTI:
            return self.multi[node].get(token, -1)
        return -1

    def children(self, node: int) -> Iterable[int]:
        kid_token = self.kid_token[node]
        if kid_token >= 0:
            return (self.kid[node],)
        return self.multi[node].values() if kid_token == MULTI else ()

    def _add_child(self, node: int, token: int, child: int) -> None:
        kid_token = self.kid_token[node]
        if kid_token == LEAF:
            self.kid_token[node], self.kid[node] = token, child
        elif kid_token == MULTI:
            self.multi[node][token] = child
        else:  # a second child: both go to a dict
            self.multi[node] = {kid_token: self.kid[node], token: child}
            self.kid_token[node] = MULTI

    def _remove_child(self, node: int, token: int) -> None:
        if self.kid_token[node] >= 0:  # its only child
            self.kid_token[node] = LEAF
            return
        kids = self.multi[node]
        del kids[token]
        if len(kids) == 1:  # back to one child: inline
            ((self.kid_token[node], self.kid[node]),) = kids.items()
            del self.multi[node]

    def _free_subtree(self, node: int) -> None:
        """Free a deleted node and what hangs below it (a chain: it held one occurrence)."""
        stack = [node]
        while stack:
            n = stack.pop()
            kid_token = self.kid_token[n]
            if kid_token >= 0:
                stack.append(self.kid[n])
            elif kid_token == MULTI:
                stack.extend(self.multi.pop(n).values())
            self._free.append(n)

    def is_lazy(self, node: int) -> bool:
        return self.kid_token[node] == LAZY

    def n_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def nbytes(self) -> int:
        """The arrays' and child dicts' size (not the sequences, which the caller holds)."""
        size = sum(a.itemsize * len(a) for a in self._columns)
        return size + sum(map(_dict_bytes, self.multi.values())) + 8 * len(self._free)

    # sequences --------------------------------------------------------------------------------

    def _seq_id(self, seq: Sequence[int]) -> int:
        """The id of a sequence, registering it the first time it is appended to."""
        if self._last is not None and self._last[0] is seq:
            return self._last[1]
        sid = self._order[-1] + 1 if self._order else 0
        self.seqs[sid] = seq
        self._order.append(sid)
        self._last = (seq, sid)
        return sid

    def append(self, seq: Sequence[int], i: int, loci: list[int]) -> list[int]:
        """Add seq[i] (seq[:i] was added, and has `loci`); returns the loci of seq[:i + 1].

        The suffix of length k ending at i extends the suffix of length k - 1 ending at i - 1,
        for k = 1 .. K + 1. Longer ones extend a string seen once: they are new, and stay
        implicit below the (lazy) node of length K + 1.
        """
        sid, token, stamp = self._seq_id(seq), seq[i], self.n_added
        self.n_added += 1
        count, out, best, link = self.count, self.out, self.best, self.link
        kid_token, kid, multi = self.kid_token, self.kid, self.multi
        seqs, pos, stamps = self.seq, self.pos, self.stamp
        new_loci = []
        shorter = ROOT  # the node of the suffix one token shorter, ending at i
        for k in range(min(len(loci) + 1, self.depth)):
            parent = loci[k - 1] if k else ROOT
            edge = kid_token[parent]  # `child` inlined: this loop is most of the cost
            if edge >= 0:
                child = kid[parent] if edge == token else -1
            else:
                child = multi[parent].get(token, -1) if edge == MULTI else -1
            if child < 0:
                child = self._new(sid, i, stamp, token)
                self._add_child(parent, token, child)
                n = 1
            else:
                if kid_token[child] == LAZY:  # its second occurrence: expand the first
                    self._expand(child, k + 1)
                n = count[child] = count[child] + 1
                seqs[child], pos[child], stamps[child] = sid, i, stamp
                new_loci.append(child)  # seen twice now: a locus (repeats form a prefix)
            out[parent] += 1
            top = best[parent]
            if top == _STALE:
                top = self._refresh(parent)
            if top < 0 or (top != child and n >= count[top]):
                best[parent] = child  # ties: the latest occurrence, this one
            link[child], shorter = shorter, child
        return new_loci

    def _expand(self, node: int, length: int) -> None:
        """Give a lazy node of `length` tokens the child its single occurrence continues with."""
        self.kid_token[node] = LEAF
        seq, nxt = self.seqs[self.seq[node]], self.pos[node] + 1
        if length < self.depth and nxt < len(seq):
            child = self._new(self.seq[node], nxt, self.stamp[node] + 1, seq[nxt])
            self.kid_token[node], self.kid[node] = seq[nxt], child
            self.out[node], self.best[node] = 1, child

    def _refresh(self, node: int) -> int:
        """Recompute a stale `best`: most occurrences, then latest."""
        count, stamp = self.count, self.stamp
        kids = self.children(node)
        top = max(kids, key=lambda c: (count[c], stamp[c]), default=_NONE)
        self.best[node] = top
        return top

    def add(self, seq: Sequence[int]) -> None:
        """Add a whole sequence (it must not change afterwards)."""
        loci: list[int] = []
        for i in range(len(seq)):
            loci = self.append(seq, i, loci)

    def remove(self, seq: Sequence[int]) -> None:
        """Remove the oldest sequence still in the trie (added with `add`).

        Each of its substrings loses an occurrence; nodes left with none are deleted. Oldest
        first keeps the other nodes' `seq, pos, stamp` valid: a node whose latest occurrence
        is in the oldest sequence has all of them there.
        """
        sid = self._order.popleft()
        assert self.seqs[sid] is seq, "remove() takes the oldest sequence"
        count, out, best = self.count, self.out, self.best
        for j in range(len(seq)):
            node = ROOT
            for q in range(j, min(j + self.depth, len(seq))):
                token = seq[q]
                child = self.child(node, token)
                assert child >= 0  # the string occurs here and in the path: expanded
                out[node] -= 1
                count[child] -= 1
                if best[node] == child:
                    best[node] = _STALE
                if count[child] == 0:  # its subtree held only this occurrence
                    self._remove_child(node, token)
                    self._free_subtree(child)
                    break
                node = child
        del self.seqs[sid]
        if self._last is not None and self._last[1] == sid:
            self._last = None

    # queries ----------------------------------------------------------------------------------

    def next_token(self, cursor: Cursor) -> tuple[int, float] | None:
        """The most frequent token after the cursor's string and its share; None if none."""
        node, off = cursor
        if self.kid_token[node] == LAZY:  # seen once: read its continuation
            seq, nxt = self.seqs[self.seq[node]], self.pos[node] + 1 + off
            return (seq[nxt], 1.0) if nxt < len(seq) else None
        top = self.best[node]
        if top == _STALE:
            top = self._refresh(node)
        if top < 0:
            return None
        return self.token[top], self.count[top] / self.out[node]

    def step(self, cursor: Cursor, token: int) -> Cursor | None:
        """The place of the cursor's string + token; None if that never occurred."""
        node, off = cursor
        if self.kid_token[node] == LAZY:
            seq, nxt = self.seqs[self.seq[node]], self.pos[node] + 1 + off
            ok = nxt < len(seq) and seq[nxt] == token
            return (node, off + 1) if ok else None
        child = self.child(node, token)
        return None if child < 0 else (child, 0)

    def locate(self, tokens: Sequence[int]) -> Cursor | None:
        """The place of a string (at most `depth` tokens); None if it never occurred.

        `step` inlined: this walk is most of the cost of a global match.
        """
        kid_token, kid, multi = self.kid_token, self.kid, self.multi
        node, off = ROOT, 0
        for token in tokens:
            edge = kid_token[node]
            if edge >= 0:
                if edge != token:
                    return None
                node = kid[node]
            elif edge == MULTI:
                node = multi[node].get(token, -1)
                if node < 0:
                    return None
            elif edge == LAZY:
                seq, nxt = self.seqs[self.seq[node]], self.pos[node] + 1 + off
                if nxt >= len(seq) or seq[nxt] != token:
                    return None
                off += 1
            else:
                return None
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


def _dict_bytes(d: dict[int, int]) -> int:
    # a dict of ints: its table (~24 bytes an entry, with slack) and the int objects
    return 64 + 48 * len(d)
