"""What the test worker scripts in tests/launcher/scripts report, read back from hvdrun's output."""

from __future__ import annotations

import json
import re


def placements(stdout: str) -> dict[int, dict]:
    """rank -> the JSON that scripts/placement.py printed as ``placement {...}``."""
    found = {}
    for line in stdout.splitlines():
        match = re.match(r"\[(\d+)\]<stdout>:placement (.*)$", line)
        if match:
            found[int(match.group(1))] = json.loads(match.group(2))
    return found
