"""What a long job's loops do to the engine: polling over and over, ever new op names."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from collectives.engine import timeline
from collectives.engine.handles import Handle
from collectives.engine.timeline import Timeline


def test_poll_loop_lets_the_finishing_thread_run() -> None:
    # A thread that spins on poll() must not keep the GIL from the thread that finishes the
    # op (the engine's). With a switch interval far longer than the test, only done()'s own
    # yield can let the other thread in.
    handle = Handle()
    gate = threading.Lock()
    gate.acquire()

    def finish() -> None:
        with gate:  # (waits without the GIL)
            handle.complete("ok")

    thread = threading.Thread(target=finish, daemon=True)
    before = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        thread.start()
        gate.release()
        polls = 0
        while not handle.done() and polls < 1_000_000:
            polls += 1
        finished = handle.done()
    finally:
        sys.setswitchinterval(before)
    thread.join(10)
    assert finished, f"not finished after {polls} polls"
    assert handle.wait() == "ok"


def test_timeline_of_ever_new_names_keeps_bounded_rows(tmp_path: Path) -> None:
    # A name per step (or unnamed ops, allreduce.noname.N) takes a row each: the timeline
    # keeps a bounded number of them in memory, while a name that repeats keeps its row.
    path = tmp_path / "timeline.json"
    line = Timeline(str(path))
    clock = time.monotonic()
    for step in range(3 * timeline.MAX_ROWS):
        for name in ("loss", f"loss.{step}"):
            line.begin(name, "NEGOTIATE_ALLREDUCE", clock)
            line.negotiated(name, "ALLREDUCE", {0: clock, 1: clock}, clock, f"0.{step}")
            line.end(name, "QUEUE", clock)
            line.end(name, "ALLREDUCE", clock)
        clock += 1e-6
        if step % 1000 == 0:
            line.flush()
    assert len(line._rows) <= timeline.MAX_ROWS
    line.close()
    events = json.loads(path.read_text())
    rows = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert len(rows) == 1 + 1 + 3 * timeline.MAX_ROWS  # (the cycles, loss, each loss.N)
    steps = [e for e in events if e.get("ph") == "E" and e["name"] == "NEGOTIATE_ALLREDUCE"]
    assert sum(e["pid"] == rows["loss"] for e in steps) == 3 * timeline.MAX_ROWS
    assert sum(e["ph"] == "B" for e in events) == sum(e["ph"] == "E" for e in events)
