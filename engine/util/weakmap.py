"""A map keyed by the identity of live objects, for state that must not outlive them."""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class WeakIdMap(Generic[K, V]):
    """A map keyed by the identity of live objects; an entry goes when its key is collected.
    Never calls the key's ``__eq__`` or ``__hash__``, and a lookup makes no reference object.
    The value must not refer to the key, or the key never dies."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref[Any], V]] = {}

    def get(self, key: K) -> V | None:
        entry = self._data.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None

    def __setitem__(self, key: K, value: V) -> None:
        ident, data = id(key), self._data

        def drop(ref: weakref.ref[Any]) -> None:
            if data.get(ident, (None,))[0] is ref:
                del data[ident]

        data[ident] = (weakref.ref(key, drop), value)

    def __len__(self) -> int:
        return len(self._data)

    def values(self) -> list[V]:
        return [value for _, value in list(self._data.values())]
