"""Limits and hung peers of an elastic job, on this machine's own hosts (no SSH needed).

``localhost`` and ``127.0.0.1`` are two hosts to hvdrun (an agent each), so a job can lose
one and go on with the other.
"""

from __future__ import annotations

from pathlib import Path

from tests.collectives.conftest import REPO, run_hvdrun

WORKER = Path(__file__).parent / "workers" / "elastic_steps.py"
TWO_HOSTS = "printf 'localhost\\n127.0.0.1\\n'"  # a discovery script


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
    assert (
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
        "hvdrun: the elastic job would need reset 1, more than --reset-limit 0; stopping the job"
        in output
    ), output


def test_hung_worker_is_dropped_after_the_rejoin_timeout() -> None:
    code, output = run_steps(
        ["--host-discovery-script", TWO_HOSTS],
        30,
        fail_host="127.0.0.1",
        fail_at_step=5,
        FAIL_MODE="hang",
        HVDRUN_GLOO_TIMEOUT_SECONDS="2",
    )
    assert code == 0, output
    assert "hanging on purpose after step 5" in output, output
    assert (
        "hvdrun: host 127.0.0.1 failed (its workers did not rejoin within 4 s after the "
        "others' collectives failed: hung or cut off)" in output
    ), output
    assert "[0]<stdout>:final rank=0 size=1 step=30 weight=-30" in output, output


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
