"""``oomguard.integrations`` is light: importing it imports neither framework until a name is used."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow  # a fresh interpreter: its torch import alone took 7.8 s on busy cores
def test_importing_the_namespace_imports_no_framework_until_a_name_is_used():
    code = ("import sys, oomguard.integrations as i\n"
            "before = [m for m in ('transformers', 'lightning', 'torch') if m in sys.modules]\n"
            "i.micro_batch_for\n"
            "print(before, 'lightning' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "False"]  # nothing by the import; no Lightning for sizing
