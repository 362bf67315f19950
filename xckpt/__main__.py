"""``python -m xckpt``: the command line."""

import sys

from xckpt.cli import main

sys.exit(main())
