"""Rank 1 runs with another fusion threshold than rank 0 (``SETTING``, a variable name,
set to ``VALUE`` on rank 1 only, as a launcher that does not pass its environment on would
leave it): ``hvd.init()`` must refuse on both ranks, with the same words, instead of
running collectives that do not match."""

from __future__ import annotations

import os
import sys

if os.environ.get("HVDRUN_RANK") == "1":
    os.environ[os.environ["SETTING"]] = os.environ["VALUE"]

import collectives.torch as hvd
from collectives.errors import SettingsMismatchError

try:
    hvd.init()
except SettingsMismatchError as error:
    print(f"REFUSED {error}", flush=True)
    sys.exit(3)
print("INIT OK", flush=True)
hvd.shutdown()
