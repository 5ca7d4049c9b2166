"""Plugins: the user's metrics, from a module name or a ``.py`` file, for jobs and every command.

:func:`load_plugin` imports a plugin (a ``.py`` path against a base folder, else a module
name), which registers its metrics; a ``.py`` plugin's folder goes first on ``sys.path``.
Each ``.py`` file is a module of its own (:func:`module_name`: two folders' ``metrics.py``
both load); a metric name defined twice, a ``sys.exit()`` at import, or any other import
failure is one line, before any work.

:func:`user_code` finds the user's files a plugin imports, transitively: a job's fingerprint
hashes them, so editing that code reruns the results it defined.

Children that do not inherit this process's imports import the same plugins through
:data:`PRELOAD`, which reads them from :data:`PLUGINS_ENV`.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import site
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from oomguard.engine.errors import first_line

__all__ = ["PLUGINS_ENV", "PRELOAD", "import_plugin", "load_plugin", "module_name",
           "resolve_plugin",
           "user_code"]

log = logging.getLogger("oomguard.plugins")

# Seconds a plugin's import may take before the log says it still runs
# (docs/measurements.md#plugin-processes).
SLOW_IMPORT_S = 30.0
PLUGINS_ENV = "OOMGUARD_PLUGINS"  # JSON list of the plugins this command loaded
PRELOAD = "oomguard.engine.jobs.plugin_preload"


def resolve_plugin(spec: str, base: Path) -> str:
    """A ``.py`` path made absolute against ``base``; a module name as it is."""
    return str((base / Path(spec).expanduser()).resolve()) if spec.endswith(".py") else spec


def module_name(path: str) -> str:
    """The module a ``.py`` plugin is imported as: its stem and a digest of its resolved
    path, so that ``a/metrics.py`` and ``b/metrics.py`` are two modules (the same in every
    process: a forkserver's child imports it under this name too)."""
    resolved = str(Path(path).resolve())
    digest = hashlib.sha256(resolved.encode("utf-8", "surrogateescape")).hexdigest()[:10]
    stem = re.sub(r"\W", "_", Path(resolved).stem)
    return f"oomguard_plugin_{stem}_{digest}"


def import_plugin(spec: str) -> tuple[str, ...]:
    """Import a plugin: a module name, or the path of a ``.py`` file (registers its metrics);
    the names of the metrics it registered (also when it was imported before)."""
    if not spec.endswith(".py"):
        return _registering(lambda: importlib.import_module(spec), spec)
    name = module_name(spec)
    if name in sys.modules:
        return getattr(sys.modules[name], _DEFINES, ())
    folder = str(Path(spec).resolve().parent)
    if folder not in sys.path:  # its own modules import by name, as a script's do
        sys.path.insert(0, folder)
    # A ``.py`` path always has a spec and a loader; a missing file fails in exec_module.
    mod_spec = importlib.util.spec_from_file_location(name, spec)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        return _registering(lambda: mod_spec.loader.exec_module(module), name)
    except BaseException:
        sys.modules.pop(name, None)
        raise


_DEFINES = "__oomguard_metrics__"  # on a plugin's module: the metrics its import registered
_BUILTIN = "oomguard.metrics."  # the package of the built-in metrics


class PluginClash(ValueError):
    """A plugin defines a metric that another plugin, or oomguard, defines (one line)."""


def _registering(run: Callable[[], Any], name: str) -> tuple[str, ...]:
    """Run ``run`` (the import of module ``name``); the metrics it registered, noted on the
    module so that a second import, which runs nothing, still knows them. PluginClash (the
    built-in kept) when it registers a built-in metric's name."""
    from oomguard.metrics.base import METRICS, load_all

    load_all()  # the built-in metrics first: a plugin that reuses one's name is seen
    before = dict(METRICS)
    run()
    defined = tuple(n for n, m in METRICS.items() if before.get(n) is not m)
    builtin = [n for n in defined if n in before and before[n].__module__.startswith(_BUILTIN)]
    if builtin:
        METRICS.update({n: before[n] for n in builtin})
        raise PluginClash(f"it defines metric {builtin[0]!r}, which oomguard's built-in "
                          "metrics define too; rename yours (its name attribute)")
    module = sys.modules.get(name)
    if module is not None and not hasattr(module, _DEFINES):
        # (an extension module's attributes may be read-only: then only this call knows)
        with contextlib.suppress(AttributeError, TypeError):
            setattr(module, _DEFINES, defined)
    return getattr(module, _DEFINES, defined) if module is not None else defined


def load_plugin(spec: str, base: Path, defined: dict[str, str] | None = None) -> str:
    """Resolve (:func:`resolve_plugin`) and import ``spec``; its resolved form, also noted
    in :data:`PLUGINS_ENV` for children. ``defined`` (metric name: plugin, filled here): the
    metrics the command's earlier plugins define. ValueError, one line, when it cannot be
    imported, exits at import, or defines a metric that oomguard or one of ``defined`` does."""
    plugin = resolve_plugin(spec, base)
    if plugin.endswith(".py") and not Path(plugin).is_file():
        raise ValueError(f"cannot import {spec!r}: no such file {plugin}; check the path "
                         "(a .py plugin is relative to the job file's folder, or the "
                         "current folder for --plugin)")
    # An import that hangs (a plugin waiting for input, a lock or a server) says so once.
    notice = threading.Timer(SLOW_IMPORT_S, log.warning, (
        "importing plugin %r has taken %g s so far; if it hangs, press Ctrl-C and move the "
        "work it does at import into its metric", spec, SLOW_IMPORT_S))
    notice.daemon = True
    notice.start()
    try:
        names = import_plugin(plugin)
    except PluginClash as exc:
        raise ValueError(f"cannot import {spec!r}: {exc}") from None
    except SystemExit as exc:  # not a command's end: nothing ran yet, and nothing is lost
        raise ValueError(f"cannot import {spec!r}: it called sys.exit({exc.code!r}) while "
                         "being imported; remove that call, or put it under "
                         "'if __name__ == \"__main__\":'") from None
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ValueError(f"cannot import {spec!r}: {first_line(exc) or type(exc).__name__}; "
                         "fix the plugin so that it imports, or leave it out") from None
    finally:
        notice.cancel()
    if defined is not None:
        _check_unique(spec, plugin, names, defined)
    loaded = json.loads(os.environ.get(PLUGINS_ENV) or "[]")
    if plugin not in loaded:
        os.environ[PLUGINS_ENV] = json.dumps([*loaded, plugin])
    return plugin


def _check_unique(spec: str, plugin: str, names: Iterable[str], defined: dict[str, str]) -> None:
    """ValueError naming both plugins when ``plugin`` defines a metric that an earlier one
    in ``defined`` defines; else its metrics added to ``defined``."""
    for name in names:
        other = defined.get(name, plugin)
        if other != plugin:
            raise ValueError(f"{spec!r} ({plugin}) defines metric {name!r}, which {other} "
                             "defines too; rename one of them (its name attribute)")
    defined.update(dict.fromkeys(names, plugin))


def _installed_roots() -> tuple[str, ...]:
    """Folders whose modules are not the user's: the interpreter's prefixes (standard
    library, site-packages of the environment) and every site-packages folder."""
    paths = sysconfig.get_paths()
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             *(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)}
    try:
        roots.update(site.getsitepackages())
    except AttributeError:  # pragma: no cover - some virtualenvs' site lacks it
        pass
    roots.add(site.getusersitepackages())
    return tuple(str(Path(r).resolve()) + os.sep for r in roots if r)


def _is_user_code(name: str, origin: str | None, roots: tuple[str, ...]) -> bool:
    if not origin or not origin.endswith(".py") or name.partition(".")[0] == "oomguard":
        return False
    return not str(Path(origin).resolve()).startswith(roots)


def _users_package(top: str, roots: tuple[str, ...]) -> bool:
    """Whether the top-level module or package ``top`` is the user's (found without
    running it): not oomguard, not the standard library, not under ``roots``. Only then are
    its submodules looked up, so that a lazy ``import scipy.sparse`` imports nothing here."""
    if top == "oomguard" or top in sys.stdlib_module_names:
        return False
    module = sys.modules.get(top)
    try:
        spec = module.__spec__ if module is not None else importlib.util.find_spec(top)
    except (ImportError, ValueError, AttributeError):
        return False
    if spec is None:
        return False
    places = [spec.origin] if spec.has_location and spec.origin else list(
        spec.submodule_search_locations or ())  # a namespace package: its folders
    return any(not str(Path(p).resolve()).startswith(roots) for p in places)


def _origin(name: str) -> str | None:
    """The file of module ``name``: from ``sys.modules``, else found without running it
    (a dotted name imports its parent package, as the import would)."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    try:
        spec = importlib.util.find_spec(name)
    except Exception:  # noqa: BLE001 - not found, or a user package that fails to import
        return None  # (the plugin's own import says so, with its traceback)
    return spec.origin if spec is not None and spec.has_location else None


def _prefixes(name: str) -> Iterator[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``: importing a module imports its packages."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def _imports(origin: str, package: str) -> Iterator[str]:
    """The absolute module names the file ``origin`` (of package ``package``) imports,
    anywhere in it; ``from m import x`` names ``m`` and ``m.x`` (x may be a module)."""
    try:
        tree = ast.parse(Path(origin).read_bytes(), origin)
    except (OSError, SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _prefixes(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                try:
                    base = importlib.util.resolve_name("." * node.level + base, package)
                except (ImportError, ValueError):
                    continue
            if base:
                yield from _prefixes(base)
            for alias in node.names:
                if alias.name != "*":
                    yield f"{base}.{alias.name}" if base else alias.name


def _plugin_module(plugin: str) -> tuple[str, str | None]:
    """The module name and file of a plugin (resolved, as :func:`resolve_plugin` gives it)."""
    if plugin.endswith(".py"):
        return module_name(plugin), plugin
    return plugin, _origin(plugin)


def user_code(plugins: Iterable[str]) -> list[str]:
    """The files (absolute, sorted) of the user's code that ``plugins`` (resolved) import,
    transitively: ``.py`` files outside the standard library, the installed packages and
    oomguard (a ``.py`` plugin's own file is hashed as the plugin, not here)."""
    roots = _installed_roots()
    seen: dict[str, bool] = {}  # file: whether it is the user's code
    users: dict[str, bool] = {}  # top-level name: whether it is the user's package
    queue = []
    for plugin in plugins:
        name, origin = _plugin_module(plugin)
        if origin:
            queue.append((name, origin, not plugin.endswith(".py")
                          and _is_user_code(name, origin, roots)))
    while queue:
        name, origin, ours = queue.pop()
        key = str(Path(origin).resolve())
        if key in seen:
            continue
        seen[key] = ours
        package = name if origin.endswith("__init__.py") else name.rpartition(".")[0]
        for imported in _imports(origin, package):
            top = imported.partition(".")[0]
            if top not in users:
                users[top] = _users_package(top, roots)
            found = _origin(imported) if users[top] else None
            if _is_user_code(imported, found, roots):
                queue.append((imported, found, True))
    return sorted(file for file, ours in seen.items() if ours)
