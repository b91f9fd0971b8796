"""A rank that waits in ``hvd.join()`` while the others still work is no stall."""

from __future__ import annotations

import logging

import pytest

from collectives.engine.config import EngineConfig
from collectives.engine.negotiation import Entry, Table
from collectives.engine.requests import FIELD, Kind
from collectives.engine.stall import StallInspector


def _everyone(entry: Entry) -> list[int]:
    return [0, 1]


def test_a_rank_waiting_in_join_is_not_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    # Rank 0 ran out of data and joined; rank 1 trains on for longer than the stall times
    # (its own ops run, so none of them stays in the table): no warning, no shutdown.
    config = EngineConfig(stall_warning_seconds=2.0, stall_shutdown_seconds=4.0)
    inspector = StallInspector(config, rank=0, inspects=True)
    table = Table(size=2)
    join = FIELD.join([str(int(Kind.JOIN)), "0", "join", "", ""])
    table.add(0, join.encode(), cycle=1, now=100.0)
    with caplog.at_level(logging.WARNING, logger="collectives.engine"):
        assert not inspector.check(table, _everyone, now=200.0)
    assert "stall" not in caplog.text, caplog.text
    # An op that waits for a rank still stops the job at the shutdown time.
    stalled = Table(size=2)
    stalled.add(0, FIELD.join([str(int(Kind.ALLREDUCE)), "0", "x", "sig", "1"]).encode(), 1, 0.0)
    assert StallInspector(config, rank=0, inspects=True).check(stalled, _everyone, now=5.0)
