"""Imported by a forkserver (named in its preload by :func:`~oomguard.engine.cli.options.load_plugins`):
imports the plugins the command loaded (:data:`~oomguard.engine.jobs.plugins.PLUGINS_ENV`), so
that an isolated trial's child knows their metrics. A forked child inherits them instead."""

from __future__ import annotations

import contextlib
import json
import os

from oomguard.engine.jobs.plugins import PLUGINS_ENV, import_plugin

for _plugin in json.loads(os.environ.get(PLUGINS_ENV) or "[]"):
    # The server must start even if it fails here, or exits (sys.exit at import): the
    # trial then names the metric.
    with contextlib.suppress(Exception, SystemExit):
        import_plugin(_plugin)
