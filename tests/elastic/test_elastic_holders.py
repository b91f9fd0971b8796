"""Who holds the training state when hosts come and go in quick succession: a host is added,
then the original one removed, on this machine's own hosts (``localhost`` and ``127.0.0.1``
are two hosts to hvdrun, an agent each; no SSH needed).

The discovery script answers ``localhost:2``, then both hosts, then ``127.0.0.1:2`` (a node
added, then the old node taken back, as spot capacity does). The workers on 127.0.0.1
receive the state from localhost's in the generation that adds them; the job must go on
with them, unless nobody alive holds the state any more.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from tests.elastic.test_elastic_jobs import (
    Job,
    after_step,
    at_size,
    check_finished_exactly,
    check_steps_never_go_back,
    elastic_args,
)

SYNC_WAITING = (
    "hvdrun: the workers on 127.0.0.1 are still receiving the training state from localhost, "
    "which discovery removed: the removal waits for them to hold it"
)
LOST = "the training state is lost"


def answer(path: Path, *hosts: str) -> None:
    """Makes the discovery script (``cat path``) answer ``hosts``, atomically."""
    temporary = path.with_suffix(".new")
    temporary.write_text("".join(f"{host}\n" for host in hosts))
    os.replace(temporary, path)


def added_then_removed(
    tmp_path: Path, *options: str, remove_at_generation_2: bool = False, **env: str
) -> tuple[Job, Path]:
    """The schedule: localhost:2 alone; both hosts after step 5; then 127.0.0.1:2 alone,
    after a step at size 4 (or, with ``remove_at_generation_2``, as soon as hvdrun publishes
    the generation that adds 127.0.0.1). Returns the job and its STOP_FILE."""
    discovery = tmp_path / "hosts.txt"
    answer(discovery, "localhost:2")
    stop = tmp_path / "stop"
    job = Job(
        None,
        "-np", "2", "--min-np", "2", *options, "-x", f"STOP_FILE={stop}",
        *elastic_args(discovery, 100000),
        env=env,
    )  # fmt: skip
    job.when(after_step(5), lambda: answer(discovery, "localhost:2", "127.0.0.1:2"))
    removal = (
        (lambda line: "generation 2: 4 worker(s)" in line)
        if remove_at_generation_2
        else after_step(1, size=4)
    )
    job.when(removal, lambda: answer(discovery, "127.0.0.1:2"))
    return job, stop


def check_trained_on(output: str) -> None:
    """The job went on with 127.0.0.1's workers from the steps committed before: rank 0
    moved there, the next generation ran at size 2, the weights equal the steps."""
    assert "hvdrun: generation 2: 4 worker(s) on 2 host(s): localhost, 127.0.0.1" in output
    assert "hvdrun: generation 3: 2 worker(s) on 1 host(s): 127.0.0.1" in output, output
    assert LOST not in output and "No hosts from previous set" not in output, output
    assert "leaving the elastic job: host 'localhost' is no longer part" in output, output
    check_steps_never_go_back(output)  # no start over from the initial state
    check_finished_exactly(output, None, size=2)


def test_a_host_added_then_the_original_removed_trains_on(tmp_path: Path) -> None:
    # The removal comes after the workers on 127.0.0.1 synced and trained at size 4.
    job, stop = added_then_removed(tmp_path)
    job.when(at_size(2, generation=3), stop.touch)
    code, output = job.wait()
    assert code == 0, output
    assert SYNC_WAITING not in output, output
    check_trained_on(output)


def test_a_removal_during_the_sync_waits_for_it(tmp_path: Path) -> None:
    # 127.0.0.1's workers start only once hvdrun said it waits for them: the removal
    # surely comes while the generation that adds them syncs.
    started = tmp_path / "start"
    job, stop = added_then_removed(
        tmp_path,
        remove_at_generation_2=True,
        SLOW_HOST="127.0.0.1",
        START_FILE=str(started),
    )
    job.when(lambda line: SYNC_WAITING in line, started.touch)
    job.when(at_size(2, generation=3), stop.touch)
    code, output = job.wait()
    assert code == 0, output
    assert SYNC_WAITING in output, output
    check_trained_on(output)


def test_over_the_reset_limit_the_job_ends_with_horovods_sentence(tmp_path: Path) -> None:
    # generation 2 is reset 1; the removal needs reset 2
    job, _ = added_then_removed(tmp_path, "--reset-limit", "1")
    code, output = job.wait()
    assert code == 1, output
    assert (
        "hvdrun: Horovod was shutdown because number of resets during elastic job exceeded "
        "limit: 1\n"
        "hvdrun: the elastic job would need reset 2, more than --reset-limit 1; stopping the job"
        in output
    ), output
    assert LOST not in output, output


def test_the_leaving_holders_die_during_the_sync_and_the_state_is_lost(tmp_path: Path) -> None:
    # As above, but localhost's workers, the only holders, are killed while hvdrun waits
    # for 127.0.0.1's to receive the state (they never start): a real loss.
    job, _ = added_then_removed(
        tmp_path,
        remove_at_generation_2=True,
        SLOW_HOST="127.0.0.1",
        START_FILE=str(tmp_path / "never"),
    )

    def kill_localhost_workers() -> None:
        for proc in psutil.Process(job.proc.pid).children(recursive=True):
            try:
                if proc.environ().get("HVDRUN_HOSTNAME") == "localhost":
                    proc.kill()
            except psutil.Error:
                continue

    job.when(lambda line: SYNC_WAITING in line, kill_localhost_workers)
    code, output = job.wait()
    assert code == 1, output
    assert SYNC_WAITING in output, output
    assert (
        "hvdrun: the training state is lost: every worker that held it is gone, and the "
        "workers left (127.0.0.1) never received it" in output
    ), output
    assert "final " not in output, output
