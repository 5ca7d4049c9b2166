"""How a search picks the next size: ``search(fn, strategy=Doubling(start=64))``.
:class:`Guided` (the default) predicts from measured peaks; :class:`ExpandBisect` adds a step, then
bisects; :class:`Doubling` multiplies; :class:`LinearJump` aims at a capacity in bytes."""

from oomguard.engine.core.search.strategies import E10, Doubling, ExpandBisect, Guided, LinearJump

__all__ = ["Doubling", "E10", "ExpandBisect", "Guided", "LinearJump"]
