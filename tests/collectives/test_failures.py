"""A worker's behaviour when its job breaks: a dead peer, a lost rendezvous, a bad secret;
and what the errors of ranks that disagree say.

The multi-process tests use a small rendezvous harness instead of hvdrun, because hvdrun
stops the other workers as soon as one fails and would hide the survivor's own exit code
and stderr.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from collectives.common import ReduceOp
from collectives.engine.config import EngineConfig
from collectives.engine.negotiation import Table
from collectives.engine.requests import FIELD, Kind, describe_mismatch, signature
from collectives.engine.stall import StallInspector
from tests.collectives.conftest import Harness


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_dead_peer_raises_horovod_internal_error(make_harness: Callable[[int], Harness]) -> None:
    harness = make_harness(2)
    workers = [harness.spawn(rank, "peer-death") for rank in range(2)]
    outputs = [worker.communicate(timeout=60) for worker in workers]
    assert workers[1].returncode == 7, outputs[1]
    assert workers[0].returncode == 3, outputs[0]
    assert "caught HorovodInternalError" in outputs[0][0]
    elapsed = float(outputs[0][0].split("after ")[1].split(" s")[0])
    assert elapsed < 10
    # Its figures cover the rounds up to the failure, though no flush compared them: the
    # end-of-job table showed 0 ms for a rank that had run collectives for seconds.
    busy, total = re.search(r"time in collectives ([\d.]+) s of ([\d.]+) s", outputs[0][0]).groups()
    assert 0.0 < float(busy) <= float(total), outputs[0][0]


def test_killed_peer_fails_pending_and_later_ops(make_harness: Callable[[int], Harness]) -> None:
    harness = make_harness(3)
    workers = [harness.spawn(rank, "kill-pending") for rank in range(3)]
    outputs = [worker.communicate(timeout=60) for worker in workers]
    assert workers[2].returncode == -9, outputs[2]
    for rank in (0, 1):
        stdout, stderr = outputs[rank]
        assert workers[rank].returncode == 3, stdout + stderr
        assert "4 ops raised HorovodInternalError within" in stdout, stdout + stderr
        elapsed = float(stdout.split("within ")[1].split(" s")[0])
        assert elapsed < 5, stdout
        assert "a peer process has probably died" in stdout, stdout


def test_survivor_does_not_wait_for_a_survivor_that_failed(
    make_harness: Callable[[int], Harness], tmp_path: Path
) -> None:
    """Rank 3 dies while the others wait for it inside one collective. Gloo's ring connects
    it to ranks 0 and 2 only, which see the closed connections; rank 1 waits on rank 0, whose
    engine must close its own connections when it fails (not only destroy its groups while
    still holding them): every survivor fails soon after the death (1.5 s after its op
    started), not after the 20 s collective timeout, though all of them stay alive."""
    harness = make_harness(4)
    env = {"HVDRUN_GLOO_TIMEOUT_SECONDS": "20"}
    workers = [harness.spawn(rank, "stranded", str(tmp_path), extra_env=env) for rank in range(4)]
    outputs = [worker.communicate(timeout=90) for worker in workers]
    assert workers[3].returncode == -9, outputs[3]
    for rank in (0, 1, 2):
        stdout, stderr = outputs[rank]
        assert workers[rank].returncode == 3, stdout + stderr
        elapsed = float(stdout.split("after ")[1].split(" s")[0])
        assert elapsed < 6, f"rank {rank}: {stdout}"
        assert "HVDRUN_GLOO_TIMEOUT_SECONDS=20" in stdout, stdout


def test_hung_peer_fails_after_the_collective_timeout(
    make_harness: Callable[[int], Harness],
) -> None:
    harness = make_harness(2)
    env = {"HVDRUN_GLOO_TIMEOUT_SECONDS": "2"}
    workers = [harness.spawn(rank, "hung-peer", extra_env=env) for rank in range(2)]
    try:
        stdout, stderr = workers[0].communicate(timeout=60)
    finally:
        workers[1].kill()
        workers[1].communicate(timeout=30)
    assert workers[0].returncode == 3, stdout + stderr
    elapsed = float(stdout.split("after ")[1].split(" s")[0])
    assert 1.5 < elapsed < 10, stdout
    assert "HVDRUN_GLOO_TIMEOUT_SECONDS=2" in stdout


@pytest.mark.parametrize(("path", "now"), [("fused", 0), ("predicted", 1), ("grown", 5)])
def test_tensor_resized_in_flight_fails_its_rank_clearly(
    make_harness: Callable[[int], Harness], path: str, now: int
) -> None:
    """A tensor resized while its op is in flight: a collective of the new size would make
    Gloo abort both processes; instead that rank's engine fails naming the op (not blaming
    a peer), and the peer fails because that rank went away."""
    harness = make_harness(2)
    env = {"HVDRUN_CYCLE_TIME": "300"}
    workers = [harness.spawn(rank, "local-error", path, extra_env=env) for rank in range(2)]
    outputs = [worker.communicate(timeout=60) for worker in workers]
    for rank in range(2):
        stdout, stderr = outputs[rank]
        assert workers[rank].returncode == 3, stdout + stderr
        assert float(stdout.split("after ")[1].split(" s")[0]) < 10, stdout
        predicted = int(stdout.split("predicted rounds before: ")[1].split()[0])
        assert (predicted > 0) == (path != "fused"), stdout
    local, peer = outputs[0][0], outputs[1][0]
    assert "rank 0: the collectives engine failed on this rank itself" in local, local
    resized = f"allreduce 'a': its tensor was resized while the op was in flight (now [{now}], "
    assert resized + "submitted as [3])" in local, local
    assert "rank 1: a collective failed, so a peer process has probably died" in peer, peer


def test_stall_inspector_warns_then_shuts_down(make_harness: Callable[[int], Harness]) -> None:
    harness = make_harness(2)
    env = {"HVDRUN_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    workers = [harness.spawn(rank, "stall", extra_env=env) for rank in range(2)]
    outputs = [worker.communicate(timeout=60) for worker in workers]
    for rank in range(2):
        stdout, stderr = outputs[rank]
        assert workers[rank].returncode == 3, stdout + stderr
        elapsed = float(stdout.split("after ")[1].split(" s")[0])
        assert 2.5 < elapsed < 10, stdout
        assert "HVDRUN_STALL_SHUTDOWN_TIME_SECONDS=3" in stdout, stdout
        assert "allreduce 'stuck'" in stdout and "missing ranks [1]" in stdout, stdout
    warning = outputs[0][1]
    assert "stall inspector" in warning and "allreduce 'stuck'" in warning, warning
    assert "submitted by ranks [0], missing ranks [1]" in warning, warning


def _sum(*tensors: torch.Tensor) -> str:
    return signature(Kind.ALLREDUCE, (int(ReduceOp.SUM), 1.0, 1.0), list(tensors))


def test_mismatch_errors_say_what_the_script_submitted() -> None:
    """An op=Adasum allreduce travels as an allgather of one row per rank
    (``collectives.ops``): errors and the stall inspector name the allreduce the script
    submitted, and its shape. An unnamed op's error says how unnamed ops pair up (ranks that
    submit them in different orders pair different tensors)."""
    rows = {r: signature(Kind.ALLGATHER, (), [torch.ones(1, 3 + r)]) for r in range(2)}
    size = describe_mismatch(Kind.ALLGATHER, "allgather.adasum.x", rows)
    assert size == (
        "allreduce 'x' (op=Adasum): ranks disagree on the shape: rank 0: [3]; rank 1: [4]"
    )
    same_size = {r: signature(Kind.ALLGATHER, (), [torch.ones(1, 2 + r, 3 - r)]) for r in (0, 1)}
    assert describe_mismatch(Kind.ALLGATHER, "allgather.adasum.z", same_size).endswith(
        "ranks disagree on the shape: rank 0: [2, 3]; rank 1: [3, 2]"
    )
    unnamed = describe_mismatch(Kind.ALLGATHER, "allgather.adasum.allreduce.noname.2", rows)
    assert unnamed.startswith("allreduce 'noname.2' (op=Adasum): ranks disagree on the shape")
    assert "each rank's unnamed allreduce number 2 (counted from 0" in unnamed, unnamed
    order = describe_mismatch(
        Kind.ALLREDUCE, "allreduce.noname.0", {0: _sum(torch.ones(3)), 1: _sum(torch.ones(5))}
    )
    assert order == (
        "allreduce 'noname.0': ranks disagree on the shape: rank 0: [3]; rank 1: [5]. The op "
        "has no name: it is each rank's unnamed allreduce number 0 (counted from 0 per kind and "
        "process set), so ranks that submit unnamed ops in different orders pair different "
        "tensors; give the ops names (name=...)"
    )
    named = describe_mismatch(
        Kind.ALLREDUCE, "allreduce.x", {0: _sum(torch.ones(3)), 1: _sum(torch.ones(5))}
    )
    assert "no name" not in named, named
    # Adasum on rank 0, Sum on rank 1 under one name: a stall, reported as two allreduces.
    table = Table(size=2)
    adasum = FIELD.join(["1", "0", "allgather.adasum.y", rows[0], ""])
    table.add(0, adasum.encode(), cycle=1, now=100.0)
    plain = FIELD.join(["0", "0", "allreduce.y", _sum(torch.ones(3)), ""])
    table.add(1, plain.encode(), cycle=1, now=100.0)
    config = EngineConfig(stall_warning_seconds=1.0, stall_shutdown_seconds=2.0)
    report = StallInspector(config, rank=0, inspects=True).report(
        table, lambda entry: [0, 1], 102.5, aborting=True
    )
    assert "  allreduce 'y' (op=Adasum) (process set 0, waiting 2 s): submitted by ranks [0], " \
        "missing ranks [1]\n  allreduce 'y' (process set 0, waiting 2 s): submitted by ranks " \
        "[1], missing ranks [0]\n  one name, different ops: allreduce 'y' (op=Adasum) on ranks " \
        "[0]; allreduce 'y' on ranks [1]; these never meet (give different ops different " \
        "names)" in report, report  # fmt: skip
    # Ranks 0 and 1 each submitted an unnamed allreduce and an unnamed allgather (both
    # number 0) and rank 2 is late: a straggler, not one name given to different ops.
    late = Table(size=3)
    for rank in (0, 1):
        for kind, name, sig in (
            ("0", "allreduce.noname.0", _sum(torch.ones(3))),
            ("1", "allgather.noname.0", rows[0]),
        ):
            late.add(rank, FIELD.join([kind, "0", name, sig, ""]).encode(), cycle=1, now=100.0)
    report = StallInspector(config, rank=0, inspects=True).report(
        late, lambda entry: [0, 1, 2], 102.5
    )
    assert "missing ranks [2]" in report and "one name, different ops" not in report, report


def test_a_shutdown_time_below_the_check_time_never_shuts_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As in Horovod: a job that ran there with such a setting must not be stopped here."""
    table = Table(size=2)
    table.add(0, FIELD.join(["0", "0", "allreduce.y", _sum(torch.ones(3)), ""]).encode(), 1, 100.0)
    config = EngineConfig(stall_warning_seconds=5.0, stall_shutdown_seconds=2.0)
    with caplog.at_level("WARNING", logger="collectives.engine"):
        inspector = StallInspector(config, rank=0, inspects=True)
        assert not inspector.check(table, lambda entry: [0, 1], 103.0)
        assert not inspector.check(table, lambda entry: [0, 1], 500.0)  # warns only
    said = [record.getMessage() for record in caplog.records]
    assert said[0].startswith(
        "HVDRUN_STALL_SHUTDOWN_TIME_SECONDS=2 is less than HVDRUN_STALL_CHECK_TIME_SECONDS=5: "
        "as in Horovod, a stall will not shut the job down"
    ), said
    assert "missing ranks [1]" in said[1], said
    # At or above the check time it shuts down.
    config = EngineConfig(stall_warning_seconds=5.0, stall_shutdown_seconds=5.0)
    assert StallInspector(config, rank=0, inspects=True).check(table, lambda e: [0, 1], 105.5)


def test_one_name_given_to_different_ops_stops_the_job_at_the_stall_check_time() -> None:
    # Horovod refuses such ops (mismatched operations); here they waited forever, warned of
    # every 60 s, since no shutdown time is set by default.
    table = Table(size=2)
    table.add(0, FIELD.join(["0", "0", "allreduce.y", _sum(torch.ones(3)), ""]).encode(), 1, 100.0)
    gather = FIELD.join(
        ["1", "0", "allgather.y", signature(Kind.ALLGATHER, (), [torch.ones(1, 3)]), ""]
    )
    table.add(1, gather.encode(), 1, 100.0)
    config = EngineConfig(stall_warning_seconds=1.0, stall_shutdown_seconds=0.0)
    inspector = StallInspector(config, rank=0, inspects=True)
    assert not inspector.check(table, lambda entry: [0, 1], 100.5)  # not yet the check time
    assert inspector.check(table, lambda entry: [0, 1], 101.5)
    report = inspector.report(table, lambda entry: [0, 1], 101.5, aborting=True)
    assert report.startswith(
        "rank 0: ranks submitted different ops under one name, so these ops can never run"
    ), report
    assert "one name, different ops: allreduce 'y' on ranks [0]; allgather 'y' on ranks [1]" \
        in report, report  # fmt: skip
    # A straggler (rank 1 has submitted nothing yet) only warns.
    alone = Table(size=2)
    alone.add(0, FIELD.join(["0", "0", "allreduce.y", _sum(torch.ones(3)), ""]).encode(), 1, 100.0)
    assert not StallInspector(config, rank=0, inspects=True).check(alone, lambda e: [0, 1], 200.0)


def test_different_unnamed_ops_on_different_ranks_are_not_called_one_name() -> None:
    # Rank 0 runs an unnamed allreduce where rank 1 runs an unnamed broadcast: both are
    # number 0 of their kinds, not one name, and naming them would not help.
    table = Table(size=2)
    reduce = FIELD.join(["0", "0", "allreduce.noname.0", _sum(torch.ones(3)), ""])
    table.add(0, reduce.encode(), 1, 100.0)
    cast = signature(Kind.BROADCAST, (0,), [torch.ones(3)])
    table.add(1, FIELD.join(["2", "0", "broadcast.noname.0", cast, ""]).encode(), 1, 100.0)
    config = EngineConfig(stall_warning_seconds=1.0, stall_shutdown_seconds=0.0)
    inspector = StallInspector(config, rank=0, inspects=True)
    assert not inspector.check(table, lambda entry: [0, 1], 101.5)  # a stall: warned of
    report = inspector.report(table, lambda entry: [0, 1], 101.5)
    assert "one name" not in report and "different names" not in report, report
    assert (
        "  different unnamed ops, each rank one of them: allreduce 'noname.0' on ranks [0]; "
        "broadcast 'noname.0' on ranks [1]; each waits until every rank submits it too"
    ) in report, report


def test_rank_that_shuts_down_ends_the_collectives(
    make_harness: Callable[[int], Harness],
) -> None:
    harness = make_harness(2)
    workers = [harness.spawn(rank, "leave") for rank in range(2)]
    outputs = [worker.communicate(timeout=60) for worker in workers]
    assert workers[1].returncode == 0, outputs[1]
    stdout, stderr = outputs[0]
    assert workers[0].returncode == 3, stdout + stderr
    assert (
        "rank 1 left the job: it called hvd.shutdown() or its script ended (its last line or "
        "sys.exit)"
    ) in stdout, stdout
    assert float(stdout.split("after ")[1].split(" s")[0]) < 5, stdout


def test_lost_rendezvous_ends_worker_and_its_group(
    make_harness: Callable[[int], Harness],
) -> None:
    harness = make_harness(1)
    worker = harness.spawn(0, "lost")
    assert worker.stdout is not None
    line = worker.stdout.readline()
    assert line.startswith("ready "), line + worker.communicate(timeout=30)[1]
    child = int(line.split()[2])
    harness.stop()
    _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 1, stderr
    assert f"hvdrun: rank 0 lost its job's rendezvous at {harness.addr} (" in stderr
    assert stderr.rstrip().endswith("; exiting"), stderr
    assert harness.secret not in stderr
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), "the worker's child survived"


def test_bad_secret_fails_init_clearly(make_harness: Callable[[int], Harness]) -> None:
    harness = make_harness(1)
    worker = harness.spawn(0, "bad-secret", secret="not-the-secret")
    stdout, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stdout + stderr
    assert "init failed: hvd.init() could not register with the rendezvous" in stdout
    assert "not-the-secret" not in stdout + stderr
    assert harness.secret not in stdout + stderr
