"""Multi-process tests: real jobs launched through the hvdrun CLI, each worker script running
many checks per launch (a worker's torch import costs seconds)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.collectives.conftest import REPO, WORKERS, assert_all_ok, clean_env, run_hvdrun

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]


OPS_CHECKS = [
    "identity.unique",
    "identity.sets",
    *(
        f"{variant}.{where}.{op.upper()}.torch.{dtype}"
        for variant in ("allreduce", "allreduce_async", "allreduce_", "allreduce_async_")
        for where in ("global", "sub")
        for op in OPS
        for dtype in DTYPES
    ),
    *(f"allreduce.{where}.{op}.bool" for where in ("global", "sub") for op in ("SUM", "MIN")),
    "allreduce_.noncontiguous",
    "allreduce.large",
    "scale.global.sum",
    "scale.sub.prescale_int",
    "grouped.global.1",
    "grouped_async_.sub",
    "grouped_.global.max",
    *(f"allgather.{where}.torch.{d}" for where in ("global", "sub") for d in [*DTYPES, "bool"]),
    "allgather_async.sub.torch.float32",
    "grouped_allgather.global.1",
    "allgather.empty_rank",
    "broadcast.global.root1.torch.bool",
    "broadcast_.sub.root0.torch.bfloat16",
    "broadcast_async_.global.1",
    "broadcast.bad_root_raises",
    *(f"alltoall.{where}.torch.{d}" for where in ("global", "sub") for d in [*DTYPES, "bool"]),
    "alltoall.received.global.torch.int64",
    "alltoall.even.sub",
    "alltoall_async.global",
    *(
        f"{variant}.{where}.{split}"
        for variant in (
            "reducescatter",
            "reducescatter.avg",
            "reducescatter.scaled",
            "reducescatter_async",
            "grouped_reducescatter",
        )
        for where in ("global", "sub")
        for split in ("even", "uneven")
    ),
    "grad.allreduce.SUM",
    "grad.allreduce.AVERAGE",
    "grad.grouped_allreduce.0",
    "grad.allgather",
    "grad.grouped_allgather",
    "grad.broadcast",
    "grad.alltoall",
    "grad.reducescatter",
    "grad.grouped_reducescatter",
    "join.sum.step0",
    "join.min.step0",
    "join.prod.step0",
    "join.allgather.step0",
    "join.broadcast.step0",
    "join.last_rank",
    "join.after",
    "mismatch.shape",
    "mismatch.dtype",
    "mismatch.op",
    "mismatch.prescale",
    "mismatch.root",
    "mismatch.allgather_dims",
    "mismatch.splits",
    "mismatch.device",
    "mismatch.grouped_count",
    "mismatch.broadcast_parameters",
    "mismatch.after",
    "duplicate.raises",
    "duplicate.reuse",
    "async.result",
    "async.out_of_order",
    "threads",
    "burst",
    "allreduce.split",
    "allreduce_.split",
    "burst.mixed.0.1",
    "burst.mixed.2.89",
    "burst.mixed.2.88.in_place",
    "burst.mixed.2.grouped",
    "barrier",
    "process_set.duplicate_raises",
    "process_set.not_member_raises",
    "process_set.unregistered_raises",
    "process_set.remove",
    "process_set.readd_id",
    "broadcast_parameters",
    "objects.unpicklable_broadcast",
    "objects.unpicklable_allgather",
    "objects.after_unpicklable",
    "objects.after_unpicklable_gather",
    *(
        f"autograd.{op}.{size}"
        for op in (
            "broadcast_",
            "broadcast_async_",
            "allreduce_",
            "allreduce_async_",
            "grouped_allreduce_",
        )
        for size in (4, 1 << 20)
    ),
    "lifecycle.reinit_allreduce",
    "lifecycle.init_process_sets",
    "lifecycle.init_process_sets_op",
]


def test_ops_on_three_ranks() -> None:
    # A 1 MB fusion threshold makes "allreduce.large" run on its own, in place.
    code, output = run_hvdrun(
        3, WORKERS / "ops_worker.py", options=["--fusion-threshold-mb", "1"], timeout=240
    )
    # Rank 0 checks that an op is still pending while rank 1 has not submitted it.
    assert_all_ok(code, output, 3, OPS_CHECKS)
    assert "[2]<stdout>:OK join.sum.step2\n" in output
    assert "[2]<stdout>:OK join.allgather_refused.step2\n" in output
    assert "[0]<stdout>:OK async.pending\n" in output


def test_ops_on_two_ranks() -> None:
    code, output = run_hvdrun(2, WORKERS / "ops_worker.py", timeout=240)
    assert_all_ok(code, output, 2, OPS_CHECKS)
    assert "[1]<stdout>:OK join.sum.step1\n" in output
    assert "[1]<stdout>:OK join.broadcast_refused.step1\n" in output


def test_a_process_sets_ops_never_wait_for_ranks_outside_it() -> None:
    # Rank 0 (not in the set {1, 2}) is stopped with SIGSTOP until the set's ops are done:
    # they complete only if the set negotiates among its members alone.
    code, output = run_hvdrun(3, WORKERS / "sets_worker.py", timeout=120)
    assert_all_ok(code, output, 3, ["global.after", "remove"])
    for rank in (1, 2):
        for name in ("set.allreduce", "set.allgather", "set.repeat.9", "set.while_rank0_stopped"):
            assert f"[{rank}]<stdout>:OK {name}\n" in output, output


def test_optimizer_on_two_ranks() -> None:
    code, output = run_hvdrun(2, WORKERS / "optimizer_worker.py")
    assert_all_ok(
        code,
        output,
        2,
        [
            "optimizer_state.sgd.equal_root",
            "optimizer_state.adam.equal_root",
            "optimizer_state.adam.step_count",
            "optimizer_state.sgd.in_step",
            "optimizer_state.fresh_rank_filled",
            "optimizer_state.empty_root_dummy_step",
            "distributed_optimizer.sgd",
            "distributed_optimizer.adam",
            "distributed_optimizer.wide",
            "distributed_optimizer.wide.in_place",
            "distributed_optimizer.wide.set_grads",
            "distributed_optimizer.fp16",
            "distributed_optimizer.skip_synchronize",
            "distributed_optimizer.missing_grad",
            "distributed_optimizer.sparse",
            "distributed_optimizer.process_set",
            "fp16.average.3.2",
            "fp16.average.40000.2",
            "fp16.optimizer.1",
        ],
    )


def _events(path: Path) -> list[dict[str, Any]]:
    with open(path) as file:
        events = json.load(file)
    assert isinstance(events, list)
    return events


def _check_trace(events: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Asserts balanced B/E and monotonic timestamps per row; returns each row's phases."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    stacks: dict[int, list[str]] = {}
    last: dict[int, float] = {}
    phases: dict[str, list[str]] = {}
    for event in events:
        if event["ph"] == "M":
            continue
        pid = event["pid"]
        assert pid in names, event
        assert event["ts"] >= last.get(pid, 0.0), (names[pid], event)
        last[pid] = event["ts"]
        if event["ph"] == "B":
            if event["name"].startswith("NEGOTIATE_"):  # an op's uses of a name are one by one
                assert not stacks.get(pid), (names[pid], stacks[pid], event)
            stacks.setdefault(pid, []).append(event["name"])
            phases.setdefault(names[pid], []).append(event["name"])
        elif event["ph"] == "E":
            assert stacks.get(pid) and stacks[pid][-1] == event["name"], (names[pid], event)
            stacks[pid].pop()
    assert all(not stack for stack in stacks.values()), stacks
    return phases


def test_tuning_flags_and_timeline(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.json"
    second = tmp_path / "second-{rank}.json"
    code, output = run_hvdrun(
        2,
        WORKERS / "tuning_worker.py",
        str(second),
        options=[
            "--fusion-threshold-mb",
            "1",
            "--cycle-time-ms",
            "2.5",
            "--timeline-filename",
            str(timeline),
            "--timeline-mark-cycles",
            "--stall-check-warning-time-seconds",
            "7",
            "--stall-check-shutdown-time-seconds",
            "90",
        ],
        # Horovod's spelling of a variable reaches the runtime too.
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "45"},
    )
    assert_all_ok(code, output, 2, [])
    assert "[0]<stdout>:OK timeline.valid_while_written\n" in output
    configs = [json.loads(m) for m in re.findall(r"<stdout>:CONFIG (.*)", output)]
    assert len(configs) == 2
    assert configs[0] == configs[1]
    assert configs[0] == {
        "fusion_threshold": 1024 * 1024,
        "cycle_time_ms": 2.5,
        "timeline": str(timeline),
        "timeline_mark_cycles": True,
        "stall_check": True,
        "stall_warning_seconds": 7.0,
        "stall_shutdown_seconds": 90.0,
        "collective_timeout_seconds": 45.0,
    }
    # The flag's file: rank 0 only, cycles marked, every phase of a fused allreduce.
    phases = _check_trace(_events(timeline))
    events = _events(timeline)
    assert any(e["name"] == "CYCLE_START" and e["ph"] == "i" for e in events)
    small = phases["allreduce.first.small.3"]
    for phase in (
        "NEGOTIATE_ALLREDUCE",
        "ALLREDUCE",
        "QUEUE",
        "MEMCPY_IN_FUSION_BUFFER",
        "GLOO_ALLREDUCE",
        "MEMCPY_OUT_FUSION_BUFFER",
    ):
        assert phase in small, small
    # A tiny allreduce rides with the negotiation when both ranks announce it in the same
    # round (usually; not when one rank's round comes early, hence several of them).
    tiny = [phases[f"allreduce.first.tiny.{i}"] for i in range(5)]
    assert any("REDUCE_FROM_NEGOTIATION" in row for row in tiny), tiny
    assert all("NEGOTIATE_ALLREDUCE" in row and "ALLREDUCE" in row for row in tiny), tiny
    # An op repeated under one name runs from the response cache: each use ends its phases.
    assert phases["allreduce.first.repeat"].count("NEGOTIATE_ALLREDUCE") == 6
    assert "MEMCPY_IN_FUSION_BUFFER" not in phases["allreduce.first.large"]
    assert "GLOO_ALLREDUCE" in phases["allreduce.first.large"]
    for row, phase in [
        ("allgather.first.gather", "GLOO_ALLGATHER"),
        ("broadcast.first.bcast", "GLOO_BROADCAST"),
        ("alltoall.first.a2a", "GLOO_ALLTOALL"),
        ("reducescatter.first.rs", "GLOO_REDUCESCATTER"),
    ]:
        assert phase in phases[row], (row, phases[row])
    ticks = [e for e in events if e["ph"] == "i" and e["name"] in ("0", "1")]
    assert ticks, "no per-rank negotiation ticks"
    assert not any(name.startswith("allreduce.second") for name in phases)
    # start_timeline with {rank}: one file per rank, only the ops between start and stop.
    for rank in range(2):
        rows = _check_trace(_events(tmp_path / f"second-{rank}.json"))
        assert "allreduce.second.small.0" in rows
        assert not any(name.startswith(("allreduce.first", "allreduce.third")) for name in rows)


@pytest.mark.slow
def test_digits_example_reaches_95_percent() -> None:
    code, output = run_hvdrun(2, REPO / "examples" / "pytorch_digits.py")
    assert code == 0, output
    match = re.search(r"\[0\]<stdout>:final test accuracy: ([0-9.]+)", output)
    assert match, output
    assert float(match.group(1)) >= 0.95, output
    assert "[1]<stdout>:" not in output  # only rank 0 reports


@pytest.mark.slow
def test_digits_example_runs_without_hvdrun() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "pytorch_digits.py"), "--epochs", "2"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trained on 1 process(es)" in result.stdout
    assert re.search(r"^final test accuracy: 0\.\d{4}$", result.stdout, re.MULTILINE)


ENDING_RANK = """
import atexit, os, sys, time
if os.environ["HVDRUN_RANK"] == "0":
    atexit.register(time.sleep, 1.5)  # (runs after hvd's shutdown: rank 1 exits first)
import torch
import collectives.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(1), name="first")
if hvd.rank() == 0:
    if sys.argv[1] == "raise":
        raise RuntimeError("rank 0 breaks")
    if sys.argv[1] == "exit":
        sys.exit("rank 0 gives up")  # (exit code 1)
    sys.exit(0)  # ends its script early, cleanly
hvd.allreduce(torch.ones(1), name="never")
"""


@pytest.mark.parametrize(("how", "first"), [("raise", 0), ("exit", 0), ("end", 1)])
def test_the_rank_whose_end_ended_the_others_is_named_first(
    tmp_path: Path, how: str, first: int
) -> None:
    """Rank 0 leaves the job (its script raises, exits, or ends) and exits 1.5 s later; rank 1's
    collectives end with it and rank 1 fails at once. hvdrun names rank 0 when it failed
    too, though it heard of rank 1's exit first, and rank 1 when rank 0 exited 0."""
    script = tmp_path / "ending.py"
    script.write_text(ENDING_RANK)
    code, output = run_hvdrun(2, script, how)
    assert code == 1, output
    assert f"hvdrun: rank {first} on host localhost failed first: exit code 1" in output, output
    # Rank 1's error says how rank 0 left: its script raised, called sys.exit, or ended.
    said = {
        "raise": "rank 1: rank 0 left the job: its script ended with an uncaught exception "
        "(RuntimeError: rank 0 breaks), which ended hvdrun's collectives, so no more",
        "exit": "rank 1: rank 0 left the job: it called hvd.shutdown() or its script ended (its "
        "last line or sys.exit), which ended hvdrun's collectives, so no more",
        "end": "rank 1: rank 0 left the job: it called hvd.shutdown() or its script ended (its "
        "last line or sys.exit), which ended hvdrun's collectives, so no more",
    }
    assert said[how] in output, output
    # Rank 0 left the job before rank 1 failed, though its exit came later.
    assert ("hvdrun: before it, rank(s) 0 had exited with code 0" in output) == (how == "end")


STALLING_RANK = """
import time
import torch
import collectives.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(1), name="first")
if hvd.rank() == 1:
    time.sleep(600)  # (alive, and never submits the next op)
hvd.allreduce(torch.ones(1), name="next")
"""


def test_the_rank_that_held_the_job_up_is_named_first_after_a_stall_shutdown(
    tmp_path: Path,
) -> None:
    """Rank 1 never submits an op that rank 0 waits for; the stall inspector stops the job's
    collectives and rank 0 fails. hvdrun names rank 1, the cause, as the rank that failed
    first (its exit code: the stop's SIGTERM), not rank 0, whose exit it heard of first."""
    script = tmp_path / "stalling.py"
    script.write_text(STALLING_RANK)
    options = ("--stall-check-warning-time-seconds", "1")
    options += ("--stall-check-shutdown-time-seconds", "2")
    code, output = run_hvdrun(2, script, options=options, timeout=60)
    assert code == 1, output
    assert (
        "hvdrun: rank 1 on host localhost failed first: it never submitted allreduce 'next', "
        "which rank 0 waited for until the stall inspector stopped the job's collectives"
    ) in output, output
    assert "(rank 0 exited first, with exit code 1)" in output, output
    assert re.search(r"^hvdrun:   1\s+localhost\s+143\s+FAILED FIRST \(stalled\)", output, re.M)
    assert "last lines of rank 0's stderr (it exited first):" in output, output


NO_INIT_ON_RANK_1 = """
import os
if os.environ["HVDRUN_RANK"] != "1":
    import collectives.torch as hvd
    hvd.init()
    print("joined", flush=True)
"""


def test_a_rank_that_never_calls_init_stops_the_job_at_once(tmp_path: Path) -> None:
    """Rank 1 ends its script without hvd.init(): rank 0, waiting for it in hvd.init(), is
    not left there until the bootstrap's timeout (300 s); hvdrun names rank 1 and why."""
    script = tmp_path / "no_init.py"
    script.write_text(NO_INIT_ON_RANK_1)
    code, output = run_hvdrun(2, script, timeout=60)
    assert code == 1, output
    assert "joined" not in output
    assert (
        "hvdrun: rank 1 on host localhost failed first: it exited (code 0) without joining the "
        "job (no hvd.init()) while other ranks wait for it in hvd.init(): every rank must "
        "call hvd.init()"
    ) in output, output
