#!/usr/bin/env python
"""Thin wrapper around ``glm53flash_hf.make_tiny.main`` (the ``glm53flash-make-tiny`` console command); see ``--help``."""

import sys

from glm53flash_hf.make_tiny import main

if __name__ == "__main__":
    sys.exit(main())
