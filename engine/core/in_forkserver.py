"""Imported first by oomguard's forkserver (its preload list; :mod:`~oomguard.engine.core.child`)
and by nothing else: the server dies with the process that started it, and with it
every child it forked (each of them asks the same of the server)."""

import os

from oomguard.engine.core.child import PARENT_ENV, die_with_parent

_parent = os.environ.pop(PARENT_ENV, "")  # not for the children: they have their own parent
die_with_parent(int(_parent) if _parent else None)
