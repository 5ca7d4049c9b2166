"""Plugins: the user's metrics, from a module name or a ``.py`` file, for jobs and every command.

:func:`load_plugin` imports a plugin (a ``.py`` path against a base folder, else a module
name), which registers its metrics; a ``.py`` plugin's folder goes first on ``sys.path``.

:func:`user_code` finds the user's files a plugin imports, transitively: a job's fingerprint
hashes them, so editing that code reruns the results it defined.

Children that do not inherit this process's imports import the same plugins through
:data:`PRELOAD`, which reads them from :data:`PLUGINS_ENV`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import site
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from oomguard.engine.errors import first_line

__all__ = ["PLUGINS_ENV", "PRELOAD", "import_plugin", "load_plugin", "resolve_plugin",
           "user_code"]

PLUGINS_ENV = "OOMGUARD_PLUGINS"  # JSON list of the plugins this command loaded
PRELOAD = "oomguard.engine.jobs.plugin_preload"


def resolve_plugin(spec: str, base: Path) -> str:
    """A ``.py`` path made absolute against ``base``; a module name as it is."""
    return str((base / Path(spec).expanduser()).resolve()) if spec.endswith(".py") else spec


def import_plugin(spec: str) -> None:
    """Import a plugin: a module name, or the path of a ``.py`` file (registers its metrics)."""
    if not spec.endswith(".py"):
        importlib.import_module(spec)
        return
    name = "oomguard_plugin_" + re.sub(r"\W", "_", Path(spec).stem)
    if name in sys.modules:
        return
    folder = str(Path(spec).resolve().parent)
    if folder not in sys.path:  # its own modules import by name, as a script's do
        sys.path.insert(0, folder)
    # A ``.py`` path always has a spec and a loader; a missing file fails in exec_module.
    mod_spec = importlib.util.spec_from_file_location(name, spec)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise


def load_plugin(spec: str, base: Path) -> str:
    """Resolve (:func:`resolve_plugin`) and import ``spec``; its resolved form, also noted
    in :data:`PLUGINS_ENV` for children. ValueError, one line, when it cannot be imported."""
    plugin = resolve_plugin(spec, base)
    if plugin.endswith(".py") and not Path(plugin).is_file():
        raise ValueError(f"cannot import {spec!r}: no such file {plugin}")
    try:
        import_plugin(plugin)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ValueError(f"cannot import {spec!r}: {first_line(exc) or type(exc).__name__}") from None
    loaded = json.loads(os.environ.get(PLUGINS_ENV) or "[]")
    if plugin not in loaded:
        os.environ[PLUGINS_ENV] = json.dumps([*loaded, plugin])
    return plugin


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
        return "oomguard_plugin_" + re.sub(r"\W", "_", Path(plugin).stem), plugin
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
