"""hvdrun: Horovod-style distributed training launcher on torch.distributed."""

import sys

__version__ = "0.1.0"


def main() -> None:
    """The ``hvdrun`` command. A Ctrl-C while the CLI is still being imported ends it as a
    Ctrl-C later does (exit 130), with no traceback."""
    try:
        from hvdrun.cli import run_cli
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(run_cli())
