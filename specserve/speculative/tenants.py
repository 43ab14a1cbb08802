"""Cross-request knowledge kept apart per tenant.

Some speculators learn from every request they serve (suffix's global tree, ngram-cache's
dynamic cache, ngram-mod's table), so one request's drafts, and so its speed, can reveal
what another sent or got back. A request's tenant is its `cache_salt` (None: the default
tenant, every request that sends none); each tenant learns only from its own requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

S = TypeVar("S")

# tenants whose knowledge is kept at once; the least recently used one is forgotten first
MAX_TENANTS = 8


class PerTenant(Generic[S]):
    """One S per tenant, made by make() at the tenant's first use; at most `limit` kept."""

    def __init__(self, make: Callable[[], S], limit: int = MAX_TENANTS) -> None:
        if limit < 1:
            raise ValueError(f"need room for at least one tenant, got {limit}")
        self._make = make
        self._limit = limit
        self._items: OrderedDict[str | None, S] = OrderedDict()

    def __getitem__(self, tenant: str | None) -> S:
        item = self._items.get(tenant)
        if item is None:
            item = self._items[tenant] = self._make()
            while len(self._items) > self._limit:
                self._items.popitem(last=False)
        self._items.move_to_end(tenant)
        return item

    def __len__(self) -> int:
        return len(self._items)
