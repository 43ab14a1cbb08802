"""What a costly drafter's asks brought, ask by ask: the check on what its rates promise.

A costly drafter (a head, a draft model) is asked where its rates and price say a draft
will pay (draft_length.py). Those are estimates, and they err in its favour: each step's
best draft is the one whose estimate came out highest, and a head's calibration was taken
on other text than the request's. So every ask is also settled by what it brought, in
plain steps saved:

    saved = kept - (cost(k) - 1) - paid - against

kept being the draft tokens the target kept, cost(k) what verifying its k rows cost
(1: none verified), paid the ask's drafting as timed, and against the steps the draft it
displaced promised to save (a chain's lookup draft, as valued once the ask's draft agreed
with it or not; 0 where there was none). An ask whose draft was not verified saved -paid.
An ask after a pause is charged the drafter's steady price instead (draft_length.py):
charged its catch-up over the tokens since, a revisit costs more than an ask in a row,
and would keep a stopped drafter stopped.

Where the asks clearly lost on average (a moving average over about the last SPAN asks,
LEAST at least, below STOP_BELOW), the drafter is asked only to revisit (REVISIT), for as
long a draft as its rates say is worth it; the revisits move the average, so it comes back
where the text changes. By its rates alone the 1.5B's head promised more on prose than it
kept, and the 0.5B draft model's asks there lost more than they kept
(docs/perf/2026-11-29-ask-and-rows.md, docs/perf/2026-11-30-ask-ledger.md).

The average is kept per sequence as well as over all of them. A sequence is judged by its
own once it has LEAST asks, before that by the pooled one: a server runs prose and code
side by side, and pooled alone, one slot's paying asks kept the drafter asked at a loss on
another's prose. Before a sequence has its own record, the pooled one is the best guess,
and it carries what earlier requests taught to the next. A sequence whose asks have kept
no token at all is judged by its own record from EARLY asks on: on the 1.5B's prose its
head lost about a tenth of a step an ask for the 16 asks before its own record could stop
it (docs/perf/2026-12-04-served-prose-rerun.md).
"""

from __future__ import annotations

from dataclasses import dataclass

# the average is a plain mean of the first SPAN asks, then moves 1/SPAN of the way to each
# new one: longer than a hard stretch of an answer, short enough that revisits bring a
# drafter back within an answer
SPAN = 32
# an average over fewer asks than this does not stop a drafter: one ask saves several
# tokens or costs a fraction of a step, so a few misses say little: judged after eight, a
# draft model was at times stopped on code before its long drafts showed
# (docs/perf/2026-11-30-ask-ledger.md)
LEAST = 16
# the average must fall this far below zero to stop a drafter: stopping one about even
# saves nothing, and over SPAN asks of a few tokens or nothing each such a mean is noise;
# stopped at zero, the 1.5B's draft model was stopped on Java when about even, and the
# answer slowed (docs/perf/2026-11-30-warm-rounds.md, 2026-11-30-stop-margin.md)
STOP_BELOW = -0.1
# a sequence's own asks judge it from this many on where none kept a token: a drafter that
# pays keeps some of its first few drafts (a draft model most of them), and over eight asks
# that kept nothing a mean under STOP_BELOW is no longer noise
EARLY = 8


@dataclass
class _Open:
    """An ask whose draft is not yet settled."""

    paid: float  # its drafting, in plain steps
    against: float = 0.0  # the steps the draft it would displace promises to save
    rows: float = 1.0  # cost(k) of the rows offered for verification (1: none)


@dataclass(frozen=True)
class Mark:
    """An AskLedger's counts at one moment."""

    asks: int = 0
    saved: float = 0.0
    stops: int = 0


class AskLedger:
    """One drafter's asks and what each saved (the module doc)."""

    def __init__(self) -> None:
        self._open: dict[int, _Open] = {}
        self.asks = 0  # settled so far
        self.mean = 0.0  # the steps they saved, on average (the module doc)
        self.saved = 0.0  # and in all, with how often the average fell below STOP_BELOW
        self.stops = 0
        # slot -> its sequence's (asks, mean, tokens its asks kept)
        self._own: dict[int, tuple[int, float, int]] = {}

    def asked(self, slot: int, paid: float) -> None:
        """The drafter was asked for `slot` and paid `paid` steps; the ask before it, if
        still open, was never verified."""
        self.settle(slot, None)
        self._open[slot] = _Open(paid)

    def against(self, slot: int, saved: float) -> None:
        """The slot's draft would displace one that promises to save `saved` steps."""
        if slot in self._open:
            self._open[slot].against = saved

    def offered(self, slot: int, rows: float) -> None:
        """The slot's draft went to verification at cost(k) `rows`."""
        if slot in self._open:
            self._open[slot].rows = rows

    def settle(self, slot: int, kept: int | None) -> None:
        """The slot's open ask: its draft had `kept` tokens kept (None: not verified)."""
        ask = self._open.pop(slot, None)
        if ask is None:
            return
        saved = -ask.paid if kept is None else kept - (ask.rows - 1) - ask.paid - ask.against
        was = self.paying(slot)
        self.asks, self.mean = _moved(self.asks, self.mean, saved)
        asks, mean, tokens = self._own.get(slot, (0, 0.0, 0))
        self._own[slot] = (*_moved(asks, mean, saved), tokens + (kept or 0))
        self.saved += saved
        self.stops += int(was and not self.paying(slot))

    def mark(self) -> Mark:
        """Where the counts stand: a benchmark reports what came after it (`summary`)."""
        return Mark(self.asks, self.saved, self.stops)

    def summary(self, since: Mark | None = None) -> str:
        """What the asks saved (since `since`), for a benchmark's progress lines."""
        s = since or Mark()
        asks, saved, stops = self.asks - s.asks, self.saved - s.saved, self.stops - s.stops
        return f"{asks} asks saved {saved:+.1f} steps, stopped {stops}x"

    def forget(self, slot: int) -> None:
        """The slot starts another sequence: its open ask is its last one's, settled, and
        the new one starts with no record of its own."""
        self.settle(slot, None)
        self._own.pop(slot, None)

    def paying(self, slot: int) -> bool:
        """Whether the recent asks on the slot's sequence, or while it has fewer than LEAST
        (EARLY where none kept a token), on every sequence, did not clearly lose on average
        (or are too few to say). A margin under zero, not MIN_GAIN's over it, as the rates
        ask: a head whose asks paid on average was stopped in the hard stretches of an
        answer, and missed the easy ones after."""
        asks, mean, kept = self._own.get(slot, (0, 0.0, 0))
        if asks >= LEAST or (asks >= EARLY and not kept):
            return mean >= STOP_BELOW
        return self.asks < LEAST or self.mean >= STOP_BELOW


def _moved(asks: int, mean: float, saved: float) -> tuple[int, float]:
    """(asks, mean) after one more ask that saved `saved`: a plain mean of the first SPAN
    asks, then a moving one."""
    return asks + 1, mean + (saved - mean) / min(asks + 1, SPAN)
