"""``python -m oomguard``: the same command line as the ``oomguard`` console script."""

import sys

from oomguard.engine.cli.main import main

sys.exit(main())
