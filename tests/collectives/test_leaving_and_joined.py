"""What ranks are told of a peer that left the job or joined: how a leaving rank's script
ended (an uncaught exception, ``sys.exit``), and which missing members of a stalled op
wait in ``hvd.join()``."""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroupGloo

from collectives.engine.config import EngineConfig
from collectives.engine.core import Engine
from collectives.engine.handles import Handle
from collectives.engine.leaving import NEXT_GENERATION
from collectives.engine.negotiation import FIELD, Table
from collectives.engine.reduction import PLAIN_SUM
from collectives.engine.requests import Kind, Request, TensorSpec, signature
from collectives.engine.stall import StallInspector
from collectives.errors import HorovodInternalError
from tests.collectives.conftest import REPO, clean_env, run_hvdrun


def _allreduce(name: str) -> Request:
    tensor = torch.ones(2)
    request = Request(
        Kind.ALLREDUCE,
        f"allreduce.{name}",
        0,
        [tensor],
        [tensor],
        Handle(),
        PLAIN_SUM,
        sig=signature(Kind.ALLREDUCE, PLAIN_SUM, [tensor]),
        specs=[TensorSpec.of(tensor.dtype, tuple(tensor.shape), tensor.device.type)],
        finish=lambda r: r.outputs[0],
    )
    request.submitted = time.monotonic()
    return request


def _two_rank_engines() -> list[Engine]:
    """Two started engines of a job of two ranks, one per thread's Gloo groups."""
    store = dist.HashStore()
    engines: list[Engine | None] = [None, None]

    def start(rank: int) -> None:
        def group(prefix: str) -> Any:
            timeout = datetime.timedelta(seconds=20)
            return ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timeout)

        engine = Engine(
            rank=rank,
            size=2,
            config=EngineConfig(),
            control_group=group("control/"),
            global_group=group("data/"),
            make_groups=lambda ranks: (None, None),
            destroy_group=lambda group: None,
        )
        engine.start()
        engines[rank] = engine

    threads = [threading.Thread(target=start, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(engine is not None for engine in engines)
    return [engine for engine in engines if engine is not None]


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        (
            "its script ended with an uncaught exception (ValueError: bad shard)",
            "rank 0: rank 1 left the job: its script ended with an uncaught exception "
            "(ValueError: bad shard), which ended hvdrun's collectives, so no more collectives "
            "can run in this job",
        ),
        (
            "",
            "rank 0: rank 1 left the job: it called hvd.shutdown() or its script ended (its "
            "last line or sys.exit), which ended hvdrun's collectives, so no more collectives "
            "can run in this job",
        ),
        (  # (an elastic reset: hvd.elastic.run caught HorovodInternalError on rank 1)
            f"{NEXT_GENERATION} (hvd.elastic.run restored its last commit after "
            "collectives.errors.HorovodInternalError: again)",
            "rank 0: rank 1 left this membership generation: it left for the job's next "
            "membership generation (hvd.elastic.run restored its last commit after "
            "collectives.errors.HorovodInternalError: again), which ended the generation's "
            "collectives",
        ),
    ],
)
def test_a_peer_that_leaves_says_how_its_script_ended(failure: str, said: str) -> None:
    # Rank 0 waits in an op that rank 1 never submits; rank 1 shuts down (at its exit,
    # saying how its script failed): rank 0's op fails at once, saying so.
    first, second = _two_rank_engines()
    try:
        request = _allreduce("never")
        request.handle = first.new_handle()
        handle = first.submit(request, blocking=False)
        second.stop(timeout=20, failure=failure)
        with pytest.raises(HorovodInternalError) as raised:
            handle.wait()
        assert str(raised.value) == said
        assert first.ended_by() == 1
    finally:
        first.stop(timeout=20)
        second.stop(timeout=20)


AT_EXIT = """
import atexit, importlib.util, sys
spec = importlib.util.spec_from_file_location("exits", "collectives/runtime/exits.py")
exits = importlib.util.module_from_spec(spec)  # (alone: without the package's torch)
spec.loader.exec_module(exits)
atexit.register(lambda: print("told:", exits.describe()))
how = sys.argv[1]
if how == "raise":
    raise ValueError("bad\\nshard " + "x" * 300)
elif how == "interrupt":
    raise KeyboardInterrupt
elif how == "exit":
    sys.exit(3)
"""


def test_how_a_script_ended_is_known_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "ends.py"
    script.write_text(AT_EXIT)
    told = {}
    for how in ("raise", "interrupt", "exit", "end"):
        result = subprocess.run(
            [sys.executable, str(script), how],
            cwd=REPO,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        told[how] = result.stdout.split("told:", 1)[1].strip()
    raised = "its script ended with an uncaught exception (ValueError: bad shard " + "x" * 187
    assert told == {"raise": raised + "...)", "interrupt": "", "exit": "", "end": ""}


def test_the_stall_report_says_which_missing_members_joined() -> None:
    # An op of process set 1 (ranks 0 and 1) that rank 1 never submits: it waits in
    # hvd.join(), which the global set knows.
    table = Table(size=2)
    sig = signature(Kind.ALLREDUCE, PLAIN_SUM, [torch.ones(2)])
    table.add(0, FIELD.join(["0", "1", "allreduce.w", sig, ""]).encode(), 1, 100.0)
    inspector = StallInspector(EngineConfig(stall_warning_seconds=1.0), rank=0, inspects=True)
    inspector.joined = lambda: frozenset({1})
    report = inspector.report(table, lambda entry: [0, 1], 102.0)
    assert report.endswith(
        "  allreduce 'w' (process set 1, waiting 2 s): submitted by ranks [0], missing ranks "
        "[1] (rank 1 has joined: called hvd.join(), and a joined rank takes part in no ops "
        "of other process sets until every rank has joined; run a set's ops before its "
        "members call hvd.join())"
    ), report
    inspector.joined = frozenset  # (nobody joined: a plain straggler)
    assert inspector.report(table, lambda entry: [0, 1], 102.0).endswith("missing ranks [1]")


JOINED_MEMBER = """
import torch
import collectives.torch as hvd
hvd.init()
pair = hvd.add_process_set([0, 1])
if hvd.rank() == 0:
    try:
        hvd.allreduce(torch.ones(2), name="w", process_set=pair)
    except hvd.HorovodInternalError as error:
        print("stopped:", error, flush=True)
hvd.join()
"""


def test_an_op_waiting_for_a_joined_member_says_it_joined(tmp_path: Path) -> None:
    # Three ranks: rank 1 joins while rank 0 runs an op of the set {0, 1}: the stall
    # warning and the error of the stall inspector's shutdown say that rank 1 joined.
    script = tmp_path / "joined.py"
    script.write_text(JOINED_MEMBER)
    env = {"HVDRUN_STALL_CHECK_TIME_SECONDS": "1", "HVDRUN_STALL_SHUTDOWN_TIME_SECONDS": "2"}
    code, output = run_hvdrun(3, script, env=env, timeout=120)
    assert code == 0, output
    line = (
        r"  allreduce 'w' \(process set 1, waiting \d+ s\): submitted by ranks \[0\], missing "
        r"ranks \[1\] \(rank 1 has joined: called hvd\.join\(\), "
    )
    assert re.search(r"\[0\]<stderr>:" + line, output), output  # the warning
    # (only that set: rank 0's hvd.join() on the global set then ends the job cleanly)
    stopped = "stopped: rank 0: the stall inspector stopped process set 1's collectives (the "
    assert f"[0]<stdout>:{stopped}job's other sets go on) after " in output, output
    assert re.search(r"\[0\]<stdout>:" + line, output), output  # the error
