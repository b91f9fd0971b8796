"""hvdrun.run(fn, ...) end to end: real jobs started from this process, real workers.

The function travels to the workers through the job's rendezvous store and their results
come back the same way (tests/launcher/test_ssh.py runs one over SSH on other hosts).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

import hvdrun
from tests.processes import REPO


def no_workers_left() -> list[str]:
    """The job's processes (agents, workers) still running under this one; daemons that
    other tests of the session started (the SSH cluster's sshd) are not the job's."""
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "launcher.agent" in command or "collectives.run_task" in command:
            left.append(command)
    return left


def test_results_come_back_in_rank_order(monkeypatch: pytest.MonkeyPatch) -> None:
    scale = 10  # a closure's variable: the function travels by value (cloudpickle)
    big = os.urandom(5 * 1024 * 1024)  # over the store's 4 MiB value limit, both ways

    def train(offset: int, blob: bytes = b"") -> dict[str, object]:
        import torch

        import collectives.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
        print(f"rank {hvd.rank()} of {hvd.size()} got {len(blob)} bytes")
        return {
            "rank": hvd.rank(),
            "value": total.item() * scale + offset,
            "echo": blob if hvd.rank() == 1 else blob[:4],
        }

    out = io.StringIO()  # a stream without a binary buffer, as a notebook's is
    monkeypatch.setattr(sys, "stdout", out)
    results = hvdrun.run(train, args=(1,), kwargs={"blob": big}, num_proc=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["value"] for r in results] == [31.0, 31.0]
    assert results[0]["echo"] == big[:4] and results[1]["echo"] == big
    lines = sorted(line for line in out.getvalue().splitlines() if "got" in line)
    assert lines == [
        f"[0]<stdout>:rank 0 of 2 got {len(big)} bytes",
        f"[1]<stdout>:rank 1 of 2 got {len(big)} bytes",
    ]
    assert no_workers_left() == []


def test_a_rank_that_raises_fails_the_call_naming_it(capfd: pytest.CaptureFixture[str]) -> None:
    def train() -> int:
        import torch

        import collectives.torch as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("shard 7 is corrupt")
        hvd.allreduce(torch.ones(1))
        return 0

    with pytest.raises(hvdrun.JobFailed) as failed:
        hvdrun.run(train, num_proc=2)
    assert (
        str(failed.value) == "hvdrun.run: rank 1 on localhost raised ValueError: shard 7 is corrupt"
    )
    assert (failed.value.rank, failed.value.exit_code) == (1, 1)
    assert (failed.value.error_type, failed.value.error) == ("ValueError", "shard 7 is corrupt")
    err = capfd.readouterr().err
    # the rank's traceback starts at the function's own frame
    assert "[1]<stderr>:ValueError: shard 7 is corrupt" in err
    assert "run_task" not in err
    assert no_workers_left() == []


def test_an_elastic_call_returns_the_last_generations_results() -> None:
    def train() -> tuple[int, int, int]:
        import torch

        import collectives.torch as hvd

        hvd.init()
        state = hvd.elastic.ObjectState(epoch=0)

        @hvd.elastic.run
        def loop(state: hvd.elastic.ObjectState) -> tuple[int, int, int]:
            while state.epoch < 2:
                hvd.allreduce(torch.ones(1))
                state.epoch += 1
                state.commit()
            return hvd.rank(), hvd.size(), state.epoch

        return loop(state)

    results = hvdrun.run(train, num_proc=2, min_num_proc=1, max_num_proc=2, hosts="localhost:2")
    assert results == [(0, 2, 2), (1, 2, 2)]


def test_a_function_that_leaves_without_returning_is_named() -> None:
    with pytest.raises(hvdrun.JobFailed, match=r"rank\(s\) 0, 1 returned nothing") as raised:
        hvdrun.run(lambda: os._exit(0), num_proc=2)
    assert raised.value.rank == 0  # (the first of them, as the attribute names one)


def test_a_call_leaves_no_file_open_behind() -> None:
    # (the local agent's pipes were left to the garbage collector: a ResourceWarning each
    # in a notebook, under python -X dev or pytest's warning filters)
    script = "import hvdrun; print(hvdrun.run(lambda: 1, num_proc=1))"
    result = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0 and result.stdout == "[1]\n", result.stderr
    assert "ResourceWarning" not in result.stderr and "unclosed" not in result.stderr, result.stderr


def test_the_open_files_limit_the_job_raised_is_given_back() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 4096
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip(f"the hard limit on open files ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        assert hvdrun.run(lambda: 1, num_proc=1) == [1]  # (its rendezvous raised the limit)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (low, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_worker_that_cannot_unpickle_the_function_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import cloudpickle

    from collectives import run_task

    (tmp_path / "users_helpers.py").write_text("def work():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import users_helpers

    payload = cloudpickle.dumps((users_helpers.work, (), {}))  # (a module's function: by name)
    monkeypatch.delitem(sys.modules, "users_helpers")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    code, ok, outcome = run_task._call(payload)  # (a worker where the module is not)
    described = json.loads(outcome)
    assert (code, ok, described["type"]) == (1, False, "ModuleNotFoundError")
    assert described["message"].startswith("No module named 'users_helpers'; the function")
    assert "must import here too" in described["message"]
    assert "must import here too" in capsys.readouterr().err


def test_a_return_value_that_cannot_be_pickled_is_described_once() -> None:
    import cloudpickle

    from collectives import run_task

    code, ok, outcome = run_task._call(cloudpickle.dumps((threading.Lock, (), {})))
    described = json.loads(outcome)
    assert (code, ok, described["type"]) == (1, False, "TypeError")
    assert described["message"].startswith("the value the function returned cannot be pickled")


def test_a_rank_is_placed_by_its_last_runtime_after_hvd_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An elastic rank whose function ends with hvd.shutdown(): its place is the one its
    last generation gave it, not the slot it started in (HVDRUN_RANK)."""
    import types

    from collectives import run_task
    from collectives.runtime import state
    from rendezvous import worker_env

    monkeypatch.setattr(state, "_current", None)
    monkeypatch.setattr(state, "_last_place", None)
    monkeypatch.setenv(worker_env.RANK, "2")
    monkeypatch.setenv(worker_env.SIZE, "3")
    assert run_task._place() == ("g0-r2", {"rank": 2, "size": 3, "generation": 0})  # no init()
    runtime = types.SimpleNamespace(topology=types.SimpleNamespace(rank=0, size=2), generation=1)
    state.set_current(runtime)  # type: ignore[arg-type]  # hvd.init()
    runtime.generation, runtime.topology.rank = 2, 1  # an elastic reset
    state.set_current(None)  # hvd.shutdown()
    assert run_task._place() == ("g2-r1", {"rank": 1, "size": 2, "generation": 2})


def test_a_rank_that_raised_tells_its_peers_the_exception(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its peers are told at its exit that it failed, as for a script's uncaught exception,
    not that it left the job on purpose."""
    import cloudpickle

    from collectives import run_task
    from collectives.runtime import exits

    for name in ("last_type", "last_value", "last_traceback"):
        monkeypatch.setattr(sys, name, None, raising=False)

    def train() -> None:
        raise ValueError("shard 7 is corrupt")

    code, ok, _ = run_task._call(cloudpickle.dumps((train, (), {})))
    assert (code, ok) == (1, False)
    assert exits.describe() == (
        "its script ended with an uncaught exception (ValueError: shard 7 is corrupt)"
    )
    assert "ValueError: shard 7 is corrupt" in capsys.readouterr().err


def test_an_elastic_call_finds_its_hosts_with_a_discovery_script(tmp_path: Path) -> None:
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)

    def train() -> tuple[int, int]:
        import collectives.torch as hvd

        hvd.init()
        return hvd.rank(), hvd.size()

    results = hvdrun.run(train, num_proc=2, min_num_proc=2, host_discovery_script=script)
    assert results == [(0, 2), (1, 2)]
