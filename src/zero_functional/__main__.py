"""``python -m zero_functional``: the ``zero-functional`` command line."""

from __future__ import annotations

import sys

from zero_functional.app.cli import main

if __name__ == "__main__":  # spawned ranks re-import this module as __mp_main__
    sys.exit(main())
