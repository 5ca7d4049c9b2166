"""Imported first by oomguard's forkserver (its preload list; :mod:`~oomguard.engine.core.child`)
and by nothing else: the server dies with the process that started it, and with it
every child it forked (each of them asks the same of the server)."""

from oomguard.engine.core.child import die_with_parent

die_with_parent()
