"""``python -m mdloader``: the same command line as the ``mdloader`` console script."""

from __future__ import annotations

import sys

from mdloader.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
