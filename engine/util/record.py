"""A dataclass that round-trips through JSON and keeps what it does not know: the base of every
record oomguard writes (a search's, a task's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


class Record:
    """A dataclass written as a dict of its fields, with the keys it does not know (a file
    written by another version, an evaluator's own figures) kept in its ``extra`` field."""

    extra: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """Every field (``extra`` merged in) as a plain dict, ready for the JSON sanitiser."""
        return {**self.extra, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                 if f.name != "extra"}}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Any:
        """The record ``doc`` holds; TypeError where it is not one."""
        if not isinstance(doc, Mapping):
            raise TypeError(f"{cls.__name__} from {type(doc).__name__}, not an object")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in doc.items() if k in names},
                   extra={k: v for k, v in doc.items() if k not in names})
