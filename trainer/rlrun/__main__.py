"""``python -m rlrun``: the ``rlrun`` command line."""

from rlrun.cli import main

main()
