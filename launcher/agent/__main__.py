"""``python -m launcher.agent``: the command hvdrun runs on every host, locally or over SSH.

The module path is part of hvdrun's contract with its hosts (``launcher.transport.local``
and ``launcher.transport.remote`` start it); the agent itself is :mod:`launcher.agent.session`.
"""

import os
import sys

from launcher.agent.session import main
from launcher.transport.protocol import EXIT_MARKER, SHARED_STDIN_FLAG

if __name__ == "__main__":
    shared = SHARED_STDIN_FLAG in sys.argv[1:]
    code = main(shared_stdin=shared)
    if shared:
        sys.stdout.buffer.write(f"{EXIT_MARKER} {code}\n".encode())
    sys.stdout.flush()
    # The stdin watcher may still be blocked in readline(); a normal interpreter shutdown
    # would then abort on the buffered reader's lock, so leave without it.
    os._exit(code)
