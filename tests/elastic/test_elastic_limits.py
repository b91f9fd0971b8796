"""Limits and hung peers of an elastic job, on this machine's own hosts (no SSH needed).

``localhost`` and ``127.0.0.1`` are two hosts to hvdrun (an agent each), so a job can lose
one and go on with the other.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

from tests.collectives.conftest import REPO, clean_env, run_hvdrun
from tests.processes import assert_gone, run_stopped_for_a_while

WORKER = Path(__file__).parent / "workers" / "elastic_steps.py"
TWO_HOSTS = "printf 'localhost\\n127.0.0.1\\n'"  # a discovery script
THREE_HOSTS = "printf 'localhost\\n127.0.0.1\\n{}\\n'"  # and this machine's name


def run_steps(
    options: list[str], steps: int, fail_host: str, fail_at_step: int, **env: str
) -> tuple[int, str]:
    """``hvdrun -np 2 --min-np 1 OPTIONS`` of ``steps`` steps of workers/elastic_steps.py;
    the workers on ``fail_host`` exit 1 after step ``fail_at_step`` (or do what a
    ``FAIL_MODE`` in ``env`` says)."""
    return run_hvdrun(
        2,
        WORKER,
        options=["--min-np", "1", *options],
        env={
            "STEPS": str(steps),
            "STEP_INTERVAL": "0.05",
            "FAIL_HOST": fail_host,
            "FAIL_AT_STEP": str(fail_at_step),
            **env,
        },
        timeout=120,
    )


def test_every_host_failed_ends_the_job() -> None:
    code, output = run_steps(["-H", "localhost:2"], 100, fail_host="localhost", fail_at_step=3)
    assert code == 1, output
    assert "hvdrun: host localhost failed (worker " in output, output
    assert "exited with exit code 1); blacklisted for the rest of the job" in output, output
    # Horovod's sentence first (users match on it), then hvdrun's own
    assert (
        "hvdrun: Horovod detected that one or more processes exited with non-zero status, "
        "thus causing the job to be terminated.\n"
        "hvdrun: every worker of the elastic job has failed or left, and its training state "
        "with them; stopping the job" in output
    ), output
    assert "final" not in output


def test_more_resets_than_the_limit_end_the_job() -> None:
    code, output = run_steps(
        ["--reset-limit", "0", "--host-discovery-script", TWO_HOSTS],
        100,
        fail_host="127.0.0.1",
        fail_at_step=3,
    )
    assert code == 1, output
    assert "hvdrun: host 127.0.0.1 failed (worker 1 exited with exit code 1)" in output, output
    assert (
        "hvdrun: Horovod was shutdown because number of resets during elastic job exceeded "
        "limit: 0\n"
        "hvdrun: the elastic job would need reset 1, more than --reset-limit 0; stopping the job"
        in output
    ), output


def test_a_spare_host_fills_a_failed_hosts_slot_in_the_same_reset() -> None:
    # --max-np 2 leaves this machine's own name out (a spare) until 127.0.0.1 fails: the
    # spare joins the generation that replaces it, as in Horovod, so one reset (--reset-limit
    # 1) is enough; a survivors-only generation first would make it two.
    this = socket.gethostname()
    code, output = run_steps(
        [
            "--max-np",
            "2",
            "--reset-limit",
            "1",
            "--host-discovery-script",
            THREE_HOSTS.format(this),
        ],
        100,
        fail_host="127.0.0.1",
        fail_at_step=3,
    )
    assert code == 0, output
    assert "hvdrun: generation 1: 2 worker(s) on 2 host(s): localhost, 127.0.0.1" in output
    assert f"hvdrun: generation 2: 2 worker(s) on 2 host(s): localhost, {this}" in output
    assert "generation 3" not in output and "--reset-limit" not in output, output
    finals = re.findall(r"final rank=(\d) size=(\d) step=100 weight=-100 ", output)
    assert sorted(finals) == [("0", "2"), ("1", "2")], output


def test_a_peer_that_resets_is_said_to_leave_the_generation_not_the_job() -> None:
    """A worker's own HorovodInternalError inside hvd.elastic.run makes it reset: its peer's
    collectives fail saying that it left for the next generation and why (before: "left the
    job: it called hvd.shutdown() or its script ended"), and both train on."""
    code, output = run_steps(
        ["--host-discovery-script", TWO_HOSTS], 8, fail_host="127.0.0.1", fail_at_step=3,
        FAIL_MODE="reset",
    )  # fmt: skip
    assert code == 0, output
    assert (
        "left this membership generation: it left for the job's next membership generation "
        "(hvd.elastic.run restored its last commit after collectives.errors."
        "HorovodInternalError: resetting on purpose after step 3), which ended the "
        "generation's collectives); restoring the last commit" in output
    ), output
    assert "left the job" not in output, output


def test_hung_worker_is_dropped_after_the_rejoin_timeout_and_a_busy_one_is_not() -> None:
    # Three hosts: 127.0.0.1's worker hangs (stops itself) after step 5, while this
    # machine's own name's worker spends 8 s in its own code then, twice the rejoin window:
    # it answers hvdrun's roll call, so only the hung host fails, and it trains on.
    this = socket.gethostname()
    code, output = run_hvdrun(
        3,
        WORKER,
        options=["--min-np", "1", "--host-discovery-script", THREE_HOSTS.format(this)],
        env={
            "STEPS": "30",
            "STEP_INTERVAL": "0.05",
            "FAIL_HOST": "127.0.0.1",
            "FAIL_AT_STEP": "5",
            "FAIL_MODE": "hang",
            "LONG_STEP_HOST": this,
            "LONG_STEP_SECONDS": "8",
            "HVDRUN_GLOO_TIMEOUT_SECONDS": "2",
        },
        timeout=120,
    )
    assert code == 0, output
    assert "hanging on purpose after step 5" in output, output
    assert "a long step of its own after step 5" in output, output
    assert f"host {this} failed" not in output, output
    # (the worker stops itself with SIGSTOP: its agent sees it, hvdrun names it)
    stopped = re.search(
        r"hvdrun: worker (\d+) on 127\.0\.0\.1 was stopped by SIGSTOP \(pid \d+\): the other "
        r"workers' collectives wait for it; unless it is continued, they time out and "
        r"127\.0\.0\.1 fails for not rejoining them\n",
        output,
    )
    assert stopped is not None, output
    assert (
        "hvdrun: host 127.0.0.1 failed (its workers did not rejoin within 4 s after the "
        f"others' collectives failed: worker {stopped[1]} is stopped)" in output
    ), output
    finals = re.findall(r"final rank=(\d) size=(\d) step=30 weight=-30 ", output)
    assert sorted(finals) == [("0", "2"), ("1", "2")], output


def test_a_finished_worker_ends_the_job_and_later_discovery_failures_do_not(
    tmp_path: Path,
) -> None:
    # the script answers once (the CLI's run), then fails: the job keeps its host list
    flag = tmp_path / "ran-once"
    script = (
        f"if [ -f {flag} ]; then echo 'scheduler unreachable' >&2; exit 3; fi; "
        f"touch {flag}; {TWO_HOSTS}"
    )
    code, output = run_steps(
        ["--host-discovery-script", script],
        1000,
        fail_host="127.0.0.1",
        fail_at_step=20,
        FAIL_MODE="finish",
    )
    assert code == 0, output
    assert "hvdrun: host discovery script " in output, output
    assert (
        "failed: exited with code 3: scheduler unreachable (keeping the last host list; "
        "retrying every second)" in output
    ), output
    assert output.count("failed: exited with code 3") == 1, output  # once, not every second
    assert "finishing early after step 20" in output, output
    # its peer's collectives failed when it left; no generation comes any more
    assert (
        "hvdrun: stopping the workers on localhost: they wait for a new generation, but "
        "another worker has finished the job" in output
    ), output


def test_a_discovery_run_under_way_when_the_job_ends_is_stopped(tmp_path: Path) -> None:
    """The discovery script hangs (its scheduler does not answer) from some point on, and
    the job finishes while a run of it waits: the run and what it started end with hvdrun
    (before, they were left running, orphaned)."""
    hang = tmp_path / "hang"
    pids = tmp_path / "pids"
    script = f"if [ -f {hang} ]; then echo $$ >> {pids}; sleep 60; fi; {TWO_HOSTS}"
    worker = tmp_path / "worker.py"
    worker.write_text(
        f"import pathlib, time\npathlib.Path({str(hang)!r}).touch()\ntime.sleep(2.5)\n"
    )
    code, output = run_hvdrun(
        2, worker, options=["--min-np", "1", "--host-discovery-script", script], timeout=60
    )
    assert code == 0, output
    started = [int(pid) for pid in pids.read_text().split()]
    assert started, output  # (a run was under way: the job ends within its 10 s)
    assert_gone(started, within=5)


def test_elastic_digits_example_with_its_discovery_script() -> None:
    example = REPO / "examples" / "pytorch_elastic_digits.py"
    code, output = run_hvdrun(
        2,
        example,
        "--epochs",
        "3",
        options=[
            "--min-np",
            "1",
            "--host-discovery-script",
            str(REPO / "examples" / "elastic_discovery.sh"),
        ],
        env={"ELASTIC_HOSTS": str(REPO / "no-such-hosts-file")},  # the script's default
        timeout=120,
    )
    assert code == 0, output
    assert "hvdrun: generation 1: 2 worker(s) on 1 host(s): localhost" in output, output
    accuracy = float(output.split("final test accuracy: ")[1].split()[0])
    assert accuracy > 0.9, output


def test_two_hosts_that_come_up_a_moment_apart_start_as_one_generation() -> None:
    # Discovery offers 2 slots on each host and -np 2: the first host alone has enough, but
    # both start together (the start window), so --reset-limit 0 holds with no failure.
    code, output = run_hvdrun(
        2,
        WORKER,
        options=[
            "--min-np",
            "2",
            "--reset-limit",
            "0",
            "--host-discovery-script",
            "printf 'localhost:2\\n127.0.0.1:2\\n'",
        ],
        env={"STEPS": "10", "STEP_INTERVAL": "0.05"},
        timeout=120,
    )
    assert code == 0, output
    assert "hvdrun: generation 1: 4 worker(s) on 2 host(s): localhost, 127.0.0.1" in output
    assert "generation 2" not in output and "--reset-limit" not in output, output
    for rank in range(4):
        assert f"final rank={rank} size=4 step=10 weight=-10 resets=[]" in output, output


def test_a_stopped_hvdrun_does_not_kill_its_workers() -> None:
    # hvdrun is stopped (SIGSTOP) for longer than the old 5 s limit of workers and agents:
    # nothing it watches may count that as a lost job; the job trains on when it goes on.
    command = [
        *(sys.executable, "-m", "hvdrun", "-np", "2", "--min-np", "1"),
        *("--host-discovery-script", TWO_HOSTS, sys.executable, str(WORKER)),
    ]
    env = {**clean_env(), "STEPS": "60", "STEP_INTERVAL": "0.05"}
    code, output = run_stopped_for_a_while(command, REPO, env, "committed step=10 ", 8)
    assert code == 0, output
    assert " failed (" not in output and "lost" not in output, output
    for rank in range(2):
        assert f"final rank={rank} size=2 step=60 weight=-60" in output, output


def test_workers_still_joining_when_the_job_finishes_are_stopped_at_once() -> None:
    # 127.0.0.1's worker fails; after its cooldown the host comes back in generation 3, and
    # just then the other worker finishes. The newcomer waits for a peer that is gone: it
    # is stopped at once, and hvdrun exits 0 within seconds (not after the bootstrap's
    # 300 s store timeout).
    code, output = run_steps(
        ["--host-discovery-script", TWO_HOSTS, "--blacklist-cooldown-range", "1", "1"],
        100000,
        fail_host="127.0.0.1",
        fail_at_step=3,
        FINISH_AT_GENERATION="3",
    )
    assert code == 0, output
    assert "finishing as generation 3 comes" in output, output
    assert (
        "hvdrun: stopping the workers on 127.0.0.1: they are still joining a generation "
        "that will not train, but another worker has finished the job" in output
    ), output


def test_a_job_that_never_reached_min_np_stops_at_the_elastic_timeout() -> None:
    """The host's agent is ready but never launched (2 slots, --min-np 3): at the elastic
    timeout hvdrun stops it at once, not after the agents' report deadline (15 s more)."""
    started = time.monotonic()
    code, output = run_hvdrun(
        4,
        WORKER,
        options=[
            "--min-np", "3", "--elastic-timeout", "2",
            "--host-discovery-script", "echo localhost:2",
        ],
        timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert code == 1, output
    assert "only 2 slot(s) were available for longer than the elastic timeout (2 s)" in output
    assert elapsed < 12, f"took {elapsed:.1f} s\n{output}"
