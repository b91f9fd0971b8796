"""Forked and spawned children of a worker after ``hvd.init()`` (docs/usage.md, "Forks,
threads and DataLoader workers"): DataLoader workers see their rank's data and print no
gRPC fork warnings; a forked child answers the rank queries but runs no collectives and
cannot shut down its parent's runtime; a child process cannot join in its parent's place."""

from __future__ import annotations

import pytest

from tests.collectives.conftest import WORKERS, assert_all_ok, run_hvdrun


@pytest.mark.slow
def test_children_of_a_worker_leave_its_job_alone() -> None:
    code, output = run_hvdrun(2, WORKERS / "fork_worker.py", options=["--no-report"], timeout=120)
    assert_all_ok(
        code,
        output,
        2,
        [
            "dataloader epoch 1 shards",
            "dataloader epoch 1 sum",
            "forked child rank",
            "forked child op refused",
            "forked child init refused",
            "op after the child exited",
            "child init fails",
            "child init says why",
        ],
    )
    assert "fork_posix" not in output  # gRPC's "skipping fork() handlers", once per child


def test_a_spawned_child_running_an_unguarded_script_is_told_of_the_main_guard() -> None:
    code, output = run_hvdrun(
        1, WORKERS / "spawn_unguarded.py", options=["--no-report"], timeout=120
    )
    assert code == 0, output
    assert "spawned child exit code 1" in output, output
    assert "cannot join the job in its parent's place; this child runs the script's top level " in (
        output
    )
    assert "put the training under if __name__ == '__main__':" in output
