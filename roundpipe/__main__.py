"""``python -m roundpipe``: the command line (see :mod:`roundpipe.cli`)."""

import sys

from .cli import main

sys.exit(main())
