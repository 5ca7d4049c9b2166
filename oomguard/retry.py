"""How ``Executor`` and ``@adaptive`` shrink a size after an OOM: ``Executor(policy=...)``.
:class:`Halve` (the default) halves down to a minimum; :class:`ReduceWith` applies your function."""

from oomguard.engine.core.execute.retry import Halve, ReduceWith

__all__ = ["Halve", "ReduceWith"]
