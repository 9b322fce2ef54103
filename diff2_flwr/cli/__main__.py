"""``python -m diff2_flwr.cli``: the ``diff2`` command."""

import sys

from . import main

sys.exit(main())
