"""The memory tier: a bounded LRU of loaded kernels, keyed by cache key."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class MemoryTier:
    name = "memory"

    def __init__(self, max_entries: int = 1024) -> None:
        if max_entries < 0:
            raise ValueError(f"memory_cache_size must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._items: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Any | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def set(self, key: str, value: Any) -> None:
        if self.max_entries == 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def delete(self, key: str) -> None:
        self._items.pop(key, None)

    def clear(self) -> None:
        self._items.clear()
