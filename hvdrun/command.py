"""The ``hvdrun`` command's entry point, apart from the CLI it imports.

A Ctrl-C while the CLI is still being imported, or before hvdrun's own signal handlers are
in place (reading the command line; nothing is started yet), ends the command as a Ctrl-C
later does (exit 130), with no traceback: a line that says so.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from hvdrun.cli import run_cli

        code = run_cli()
    except KeyboardInterrupt:
        print("\nhvdrun: interrupted before the job started", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
