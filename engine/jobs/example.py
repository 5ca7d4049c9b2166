"""The commented example job file (``oomguard run --example``), kept as ``example.toml``:
package data read through :mod:`importlib.resources` (a checkout, an editable install and
a wheel alike). This module imports nothing heavy: printing the example must not load torch.
"""

from __future__ import annotations

from importlib import resources

EXAMPLE_FILE = "example.toml"


def example_text() -> str:
    """The example job file: every field, with comments; it runs as is on the tiny GPT-2."""
    return resources.files(__package__).joinpath(EXAMPLE_FILE).read_text(encoding="utf-8")
