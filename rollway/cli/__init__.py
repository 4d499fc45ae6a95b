"""The ``rollway`` command line: ``serve``, ``mock-backend``, ``demo`` and the admin commands (clients of the
admin API). Every heavy import waits until a command runs, so ``rollway --help`` starts fast."""

from rollway.cli.main import main

__all__ = ["main"]
