"""``python -m diff2_flwr.cli``: the ``diff2`` command."""

from . import console

console()
