"""The engine: one per process, shared by every frontend; it negotiates, fuses and runs
every op of this process.

Any thread submits a :class:`~collectives.engine.requests.Request` and gets a handle at
once. Each process set this rank belongs to has a
:class:`~collectives.engine.controller.Controller` that negotiates its ops among the set's
members and runs them (see :mod:`.controller`, :mod:`.cycle`); the engine routes each
request to its set's controller, owns the table of registered sets, runs the control ops
that change it, and coordinates failure and shutdown across the sets.

Process sets are registered with a negotiated op on the global set (every rank calls
``add_process_set`` in the same order): every rank creates the set's Gloo and data groups
in the same cycle, its members start the set's controller. Removal is negotiated the same
way; the members' controllers leave together in their last round.

A rank that calls ``shutdown()`` announces it in every set's last round; every rank stops
after that round (as in Horovod, a job's collectives end when one rank leaves). A cycle that
fails stops every set of the engine (:meth:`Engine.failed`).

Ownership:

* ``_sets`` (the registered process sets, by id) and ``_controllers`` (this rank's
  controllers, by set id): replaced whole (copy-on-write) by the global set's cycle when a
  control op changes them, and at construction; read by any thread, which always sees a
  consistent snapshot. The :class:`~collectives.engine.execute.Group` values are immutable.
* ``_next_set_id``: the global set's cycle (with its cycle lock).
* ``_counters``: the unnamed-op counters (see :mod:`.names`), drawn from any thread and
  caught up by the sets' cycles.
* ``_slot``: the timeline being written (see ``TimelineSlot``).
* ``config`` reads the global set's tuning, a value its cycle replaces whole;
* everything else is set in the constructor and never changed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from collectives.engine import lanes
from collectives.engine.autotune import Autotuner, Setting
from collectives.engine.cache import ResponseCache
from collectives.engine.config import EngineConfig
from collectives.engine.controller import Controller
from collectives.engine.cycle import FINAL_CYCLE_SECONDS
from collectives.engine.execute import Group
from collectives.engine.handles import Handle
from collectives.engine.insight import Summary, summarize
from collectives.engine.names import UnnamedCounters
from collectives.engine.negotiation import Entry
from collectives.engine.reduction import Reduction
from collectives.engine.requests import Kind, Request, noname, parse_signature
from collectives.engine.timeline import Timeline, TimelineSlot

__all__ = ["Engine", "HotLane", "MakeGroups"]

logger = logging.getLogger(__name__)

#: Makes a process set's two torch process groups: (Gloo group for its rounds, data group).
MakeGroups = Callable[[list[int]], tuple[Any, Any]]
#: ``Engine.run_hot(name, tensor, reduction, build)``.
HotLane = Callable[[str | None, torch.Tensor, Reduction, Callable[[int], Request]], Handle | None]


class Engine:
    """Negotiates and runs this process's collectives, one controller per process set."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        config: EngineConfig,
        control_group: Any,
        global_group: Any,
        make_groups: MakeGroups,
        destroy_group: Callable[[Any], None],
        cuda_device: int | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self._config = config  # as it started: every new set starts with it
        self._make_groups = make_groups
        self._destroy_group = destroy_group
        self._cuda_device = cuda_device
        self._slot = TimelineSlot()
        self._counters = UnnamedCounters()
        self._next_set_id = 1
        tuner = None
        if config.autotune:
            tuner = Autotuner(
                rank,
                Setting(config.fusion_threshold, config.cycle_time_ms, config.cache_capacity > 0),
                warmup_samples=config.autotune_warmup_samples,
                steps_per_sample=config.autotune_steps_per_sample,
                max_samples=config.autotune_bayes_opt_max_samples,
                noise=config.autotune_gaussian_process_noise,
                log_file=config.autotune_log,
            )
        everyone = Group(0, list(range(size)), rank)
        self._global = self._controller(everyone, control_group, global_group, tuner)
        self._sets: dict[int, Group] = {0: everyone}
        self._controllers: dict[int, Controller] = {0: self._global}
        # The hot lane of the global set (see :func:`collectives.engine.lanes.run_hot`):
        # ``run_hot(name, tensor, reduction, build)``, bound here so that the lane costs
        # no call of its own; it draws unnamed allreduces' counters from their count.
        allreduces = self._counters.count(Kind.ALLREDUCE, 0)
        self.run_hot: HotLane = functools.partial(lanes.run_hot, self._global, allreduces.__next__)

    def _controller(
        self, group: Group, control_pg: Any, data_pg: Any, tuner: Autotuner | None = None
    ) -> Controller:
        controller = Controller(
            rank=self.rank,
            group=group,
            config=self._config,
            control_pg=control_pg,
            data_pg=data_pg,
            controls=self._control,
            timeline=self._slot,
            on_failure=self.failed,
            on_stop=self.stopped,
            destroy_group=self._destroy_group,
            counters=self._counters,
            tuner=tuner,
            cuda_device=self._cuda_device,
        )
        if group.process_set_id != 0:  # (its stall reports say which members joined)
            controller.runner.stall.joined = self._joined_ranks
        return controller

    def _joined_ranks(self) -> frozenset[int]:
        """The ranks waiting in ``hvd.join()`` (an op of the global set) as of the global
        set's latest round: they take part in no other set's ops meanwhile."""
        return self._global.runner.table.joined_ranks

    # ---- what the API asks ---------------------------------------------------------

    @property
    def groups(self) -> dict[int, Group]:
        """The registered process sets by id (a snapshot: never changed once returned)."""
        return self._sets

    @property
    def config(self) -> EngineConfig:
        """The tuning the global set runs with now (autotune changes it; other sets keep
        the one they started with, since their members could not change it in step)."""
        return self._global.runner.config

    @property
    def timeline(self) -> Timeline | None:
        """The timeline being written, if any."""
        return self._slot.current

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self._slot.current = timeline

    @property
    def autotuning(self) -> bool:
        """Whether autotune is still searching (False when it is off or has settled)."""
        tuner = self._global.runner.tuner
        return tuner is not None and not tuner.done

    @property
    def response_cache(self) -> ResponseCache | None:
        """The global set's response cache (None when it is off)."""
        rounds = self._global.runner.rounds
        return rounds.cache if rounds is not None else None

    def arrivals(self) -> Summary:
        """This rank's arrival figures as of each set's latest flush (see :mod:`.insight`):
        how long it waited for others, how often it was last, what it cost them."""
        controllers = list(self._controllers.values())  # (the global set first)
        return summarize(
            [(c.group.ranks, c.group.index, c.runner.arrivals.snapshot) for c in controllers]
        )

    def flush_arrivals(self) -> bool:
        """Makes the global set's next round (within a keepalive) flush the accounting;
        False when no round will run any more (the set stopped)."""
        self._global.runner.arrivals.ask()
        return self._global.queue.running

    @property
    def stats(self) -> dict[str, int]:
        """The global set's rounds so far: cache rounds (predicted ones among them, and among
        those the hot lane's) and full negotiations (a copy)."""
        return dict(self._global.runner.stats)

    # ---- the submitting side ---------------------------------------------------------

    def start(self) -> None:
        self._global.start()

    def auto_name(self, kind: Kind, process_set_id: int) -> str:
        """Horovod-style names for unnamed ops, counted per process set and kind so that
        ranks outside a set do not shift the names of others."""
        return noname(kind, self.next_counter(kind, process_set_id))

    def next_counter(self, kind: Kind, process_set_id: int) -> int:
        """The counter of the next unnamed op of this kind in this process set (draw it
        once nothing on this rank can refuse the op any more: see :mod:`.names`)."""
        return self._counters.draw(kind, process_set_id)

    def controller(self, process_set_id: int) -> Controller:
        """This rank's controller of a registered set it belongs to."""
        controller = self._controllers.get(process_set_id)
        if controller is None:
            raise ValueError(
                f"process set {process_set_id} is not registered on rank {self.rank} "
                "(it was removed, or this rank is not a member)"
            )
        return controller

    def new_handle(self, process_set_id: int = 0) -> Handle:
        return self.controller(process_set_id).new_handle()

    def submit(self, request: Request, blocking: bool = False) -> Handle:
        """Queues a request for its set's next cycle; raises if this rank cannot run ops
        any more (see ``Submissions.add``)."""
        return self.controller(request.process_set_id).submit(request, blocking)

    def run_now(self, request: Request) -> bool:
        """The request lane (see :func:`collectives.engine.lanes.run_now`)."""
        return self.controller(request.process_set_id).run_now(request)

    # ---- failure and shutdown --------------------------------------------------------

    def failed(self, origin: Controller, message: str) -> None:
        """A cycle of ``origin`` failed: every set stops, every pending op fails."""
        for controller in self._controllers.values():
            controller.fail(message, origin=controller is origin)

    def stopped(self, origin: Controller) -> None:
        """A set stopped in its round (a member left, or the stall inspector gave up). When
        it is the global set, every other set of this rank leaves too: as in Horovod, a
        job's collectives end when one rank leaves."""
        if origin is self._global:
            message = str(origin.queue.error or "")
            for controller in self._controllers.values():
                if controller is not origin:
                    controller.leave(message)

    def ended_by(self) -> int | None:
        """The rank whose leaving (its shutdown, or the end of its script) ended this
        rank's collectives, when another rank's did."""
        return self._global.runner.ended_by

    def stalled_by(self) -> tuple[int, str] | None:
        """After the stall inspector stopped the job's collectives: the rank that never
        submitted an op this rank waited for, and the op."""
        return self._global.runner.stalled_by

    def stop(self, timeout: float | None = None, failure: str = "") -> None:
        """Announces this rank's departure in every set's last cycle and stops them
        (``failure``: how this rank's script failed, which the others are told; "" when
        it did not)."""
        controllers = list(self._controllers.values())
        for controller in controllers:
            controller.leave(failure=failure)
        for controller in controllers:
            controller.join(timeout)
        tl, self._slot.current = self._slot.current, None
        if tl is not None:
            tl.close()
        tuner = self._global.runner.tuner
        if tuner is not None:
            tuner.close()

    # ---- control ops (on the global set's cycle) -------------------------------------

    def _control(self, entry: Entry) -> Any:
        kind = entry.kind
        if kind == Kind.ADD_PROCESS_SET:
            return self._add_set(parse_signature(kind, next(iter(entry.sigs.values()))).ranks())
        if kind == Kind.REMOVE_PROCESS_SET:
            sig = parse_signature(kind, next(iter(entry.sigs.values())))
            return self._remove_set(sig.process_set_id())
        return None  # a barrier: being ready is all it waits for

    def _add_set(self, ranks: list[int]) -> int:
        """Registers a process set: every rank makes its groups (torch wants every rank to
        take part, in the same order), its members start its controller."""
        set_id = self._next_set_id
        self._next_set_id += 1
        control_pg, data_pg = self._make_groups(ranks)
        member = self.rank in ranks
        group = Group(set_id, ranks, ranks.index(self.rank) if member else -1)
        if member:
            controller = self._controller(group, control_pg, data_pg)
            controller.start()
            self._controllers = {**self._controllers, set_id: controller}
        self._sets = {**self._sets, set_id: group}
        return set_id

    def _remove_set(self, set_id: int) -> bool:
        """Unregisters a process set: its ops in flight fail, its members' controllers
        leave together (their last round) and close its groups."""
        if set_id not in self._sets or set_id == 0:
            return False
        self._sets = {key: group for key, group in self._sets.items() if key != set_id}
        self._counters.forget(set_id)
        controller = self._controllers.get(set_id)
        if controller is not None:
            self._controllers = {
                key: value for key, value in self._controllers.items() if key != set_id
            }
            controller.cancel(
                lambda request: ValueError(f"{request.label}: its process set {set_id} was removed")
            )
            controller.join(FINAL_CYCLE_SECONDS + 1.0)
        return True
