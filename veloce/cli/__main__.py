"""``python -m veloce.cli``: the ``veloce`` command (what torchrun runs on every rank)."""

import sys

from veloce.cli import main

sys.exit(main())
