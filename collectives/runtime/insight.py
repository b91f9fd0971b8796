"""Publishing this rank's arrival figures, and ``hvd.report()``.

The engine accounts for every round (:mod:`collectives.engine.insight`); this module takes
its figures out of the process:

* a :class:`Publisher` thread writes this rank's :class:`~rendezvous.insight.RankFigures`
  into the job's store (the rendezvous, or another launcher's rank 0's, or a framework's
  default group's store) under ``worker_env.INSIGHT_KEY_PREFIX`` whenever the engine
  compared rounds anew (about once a second while collectives run), and once more at
  shutdown, after the engine's last round. hvdrun reads them for its status line and its
  end-of-job table; nothing is published per op.
* :func:`report` (``hvd.report()``) asks the engine for a comparison now, then reads every
  rank's figures from the store and returns the :class:`~rendezvous.insight.JobReport`;
  jobs of other launchers get the same table that hvdrun prints. In such jobs rank 0 also
  writes the report's JSON to ``HVDRUN_REPORT_FILE`` at shutdown, once every rank's last
  figures are in, and logs a warning when one rank holds the others back (hvdrun does both
  for its own jobs).

Elastic jobs start a new engine every generation: the figures of a worker's earlier engines
are carried over, so a worker's figures cover its whole run.

Ownership: the publisher's fields belong to its thread, but for ``_carried``, ``_folded``
and ``_published`` (under ``_lock``), which :func:`finish`, :func:`report` and an elastic
reset also touch from the thread that calls them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

from collectives.engine.core import Engine
from collectives.engine.insight import Summary, add_ops
from collectives.runtime.state import RuntimeState, require
from rendezvous import worker_env
from rendezvous.insight import JobReport, LiveWatch, RankFigures, analyse, top_ops

__all__ = ["Publisher", "finish", "report", "start"]

logger = logging.getLogger(__name__)

#: How often the publisher looks for new figures (the engine compares about once a second).
PUBLISH_SECONDS = 1.0
#: How long ``hvd.report()`` and rank 0's report file wait for the other ranks' figures.
COLLECT_SECONDS = 10.0
#: How long ``hvd.report()`` waits for the engine's comparison it asked for.
FLUSH_SECONDS = 3.0


class _Board:
    """The job's store, for figures: the rendezvous client or a torch Store."""

    def __init__(self, client: Any, store: Any) -> None:
        self._client = client
        self._store = store

    def put(self, key: str, value: bytes) -> None:
        if self._client is not None:
            self._client.set(key, value)
        elif self._store is not None:
            self._store.set(key, value)

    def get(self, key: str) -> bytes | None:
        """The value, or None while the key is not set."""
        source = self._client if self._client is not None else self._store
        if source is None or not source.check([key]):
            return None
        if self._client is not None:
            return bytes(self._client.get(key, 1.0))
        return bytes(self._store.get(key))


def _key(runtime_: RuntimeState) -> str:
    """Elastic jobs: the worker's number (ranks change hands); else the rank."""
    worker = os.environ.get(worker_env.WORKER, "")
    if runtime_.elastic and worker.isdigit():
        return worker_env.INSIGHT_KEY_PREFIX + "w" + worker
    return worker_env.INSIGHT_KEY_PREFIX + str(runtime_.topology.rank)


def _add(a: Summary, b: Summary) -> Summary:
    """Two engines' figures as one (an elastic worker's generations)."""
    ops = dict(a.ops)
    add_ops(ops, b.ops)
    return Summary(
        a.flushes + b.flushes,
        a.rounds + b.rounds,
        a.held + b.held,
        a.waited + b.waited,
        a.busy + b.busy,
        a.elapsed + b.elapsed,
        a.caused + b.caused,
        max(a.peak, b.peak),
        a.last + b.last,
        ops,
        b.caused_by,
        b.last_by,
    )


_EMPTY = Summary(0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, {}, {}, {})


class Publisher:
    """Publishes this rank's figures (see the module docstring)."""

    def __init__(self, runtime_: RuntimeState) -> None:
        self._runtime = runtime_
        self._board = _Board(runtime_.client, runtime_.store)
        self._key = _key(runtime_)
        self._lock = threading.Lock()
        self._carried = _EMPTY  # earlier engines' figures
        # The engines carried in it (weakly: an id could be a later engine's once the
        # engine is gone).
        self._folded: weakref.WeakSet[Engine] = weakref.WeakSet()
        self._published = (0, -1)  # (id of the engine, its flushes) last published
        self._timeline = False  # this rank has written a timeline (goes True once, any thread)
        self._stop = threading.Event()
        self._live = LiveWatch("hvd.report() has the details") if self._watches() else None
        self._thread = threading.Thread(target=self._run, name="hvdrun-insight", daemon=True)

    def _watches(self) -> bool:
        """Rank 0 of a job that hvdrun does not watch warns about stragglers itself."""
        runtime_ = self._runtime
        return runtime_.topology.rank == 0 and runtime_.started_by != "hvdrun"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_SECONDS):
            try:
                self.publish(only_new=True)
            except Exception as error:  # the job is ending, or the store is gone
                logger.debug("could not publish the arrival figures: %s", error)

    def summary(self, engine_: Engine | None = None) -> Summary:
        engine_ = engine_ if engine_ is not None else self._runtime.engine
        with self._lock:
            carried = self._carried
            if engine_ is None or engine_ in self._folded:
                return carried
        return _add(carried, engine_.arrivals())

    def figures(self, summary: Summary, final: bool = False) -> RankFigures:
        runtime_ = self._runtime
        topology = runtime_.topology
        engine_ = runtime_.engine
        self._timeline = self._timeline or (engine_ is not None and engine_.timeline is not None)
        return RankFigures(
            rank=topology.rank,
            host=runtime_.host or os.uname().nodename,
            size=topology.size,
            generation=runtime_.generation,
            elapsed_s=summary.elapsed,
            in_collectives_s=summary.busy,
            waited_s=summary.waited,
            wait_caused_s=summary.caused,
            largest_wait_caused_s=summary.peak,
            times_last=summary.last,
            held_rounds=summary.held,
            rounds=summary.rounds,
            flushes=summary.flushes,
            final=final,
            timeline=self._timeline,
            ops=top_ops(summary.ops),
        )

    def publish(self, only_new: bool = False, final: bool = False) -> RankFigures:
        """Writes this rank's figures (``only_new``: only if the engine compared rounds
        since the last time); returns them."""
        engine_ = self._runtime.engine
        summary = self.summary(engine_)
        mark = (id(engine_), summary.flushes)
        with self._lock:
            fresh = mark != self._published
            self._published = mark
        figures = self.figures(summary, final)
        if fresh or not only_new:
            self._board.put(self._key, figures.to_json())
        if self._live is not None and fresh and engine_ is not None:
            self._watch(summary)
        return figures

    def _watch(self, summary: Summary) -> None:
        assert self._live is not None
        held = summary.held
        ranks = {
            str(rank): RankFigures(
                rank,
                wait_caused_s=caused,
                times_last=summary.last_by.get(rank, 0),
                held_rounds=held,
            )
            for rank, caused in summary.caused_by.items()
        }
        news = self._live.update(time.monotonic(), ranks)
        if news.warning:
            logger.warning("%s", news.warning)

    def engine_stopped(self, engine_: Engine) -> None:
        """An engine stopped (shutdown, or an elastic reset): its figures are carried."""
        last = engine_.arrivals()
        with self._lock:
            if engine_ not in self._folded:
                self._folded.add(engine_)
                self._carried = _add(self._carried, last)
            self._published = (0, -1)

    def collect(self, mine: RankFigures, final: bool) -> JobReport:
        """Every rank's figures as of this rank's latest comparison (``final``: their last),
        waiting for them up to :data:`COLLECT_SECONDS`; a fixed-size job's ranks only (an
        elastic job's workers publish under their numbers, which only hvdrun lists)."""
        runtime_ = self._runtime
        size = runtime_.topology.size
        found = {mine.rank: mine}
        if runtime_.elastic:
            return analyse(found.values(), size)
        deadline = time.monotonic() + COLLECT_SECONDS
        pending = [rank for rank in range(size) if rank != mine.rank]
        while pending:
            for rank in list(pending):
                value = self._board.get(worker_env.INSIGHT_KEY_PREFIX + str(rank))
                if value is None:
                    continue
                figures = found[rank] = RankFigures.from_json(value)
                if figures.final or (not final and figures.flushes >= mine.flushes):
                    pending.remove(rank)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # (a rank still pending is not up to date: what it published last, if anything)
        return analyse(found.values(), size)


def start(runtime_: RuntimeState) -> None:
    """Starts publishing this rank's figures (from ``hvd.init()``)."""
    publisher = Publisher(runtime_)
    runtime_.insight = publisher
    publisher.start()


def finish(runtime_: RuntimeState, engine_: Engine | None) -> None:
    """At shutdown, after the engine stopped: publishes this rank's last figures; rank 0 of
    another launcher's job writes ``HVDRUN_REPORT_FILE``."""
    publisher = runtime_.insight
    if not isinstance(publisher, Publisher):
        return
    publisher.stop()
    if engine_ is not None:
        publisher.engine_stopped(engine_)
    try:
        mine = publisher.publish(final=True)
        path = worker_env.setting(worker_env.REPORT_FILE)
        if path and runtime_.topology.rank == 0 and runtime_.started_by != "hvdrun":
            publisher.collect(mine, final=True).write(path)
    except Exception as error:  # the job's store may be gone with a failed job
        logger.warning("could not publish the final arrival figures: %s", error)


def report(file: str | None = None) -> JobReport:
    """The job's report as far as every rank's figures go: ``hvd.report()``."""
    runtime_ = require("hvd.report()")
    publisher = runtime_.insight
    if not isinstance(publisher, Publisher):
        raise RuntimeError("hvd.report(): this process publishes no figures")
    engine_ = runtime_.engine
    if engine_ is not None:
        before = engine_.arrivals().flushes
        running = engine_.flush_arrivals()
        deadline = time.monotonic() + (FLUSH_SECONDS if running else 0.0)
        while engine_.arrivals().flushes <= before and time.monotonic() < deadline:
            time.sleep(0.01)
    mine = publisher.publish()
    result = publisher.collect(mine, final=False)
    if file is not None:
        result.write(file)
    return result
