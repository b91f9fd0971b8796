"""horovodrun's abbreviated long options work under hvdrun (issue 28, item 5): every prefix
that names one option stands for it, an ambiguous one is an error listing the candidates, and
the command's own arguments are never read as hvdrun's."""

from __future__ import annotations

import stat
from pathlib import Path

import click
import pytest

from hvdrun.abbreviations import HOROVODRUN_LONG_OPTIONS, expand
from hvdrun.cli import cli, run_cli
from hvdrun.logging_setup import reset_logging
from tests.cli.conftest import assert_usage_error


@pytest.fixture(autouse=True)
def _restore_logging() -> object:
    yield None
    reset_logging()


def plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``hvdrun --dry-run ARGV``'s plan; it must succeed."""
    code = run_cli(["--dry-run", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def cli_options() -> dict[str, tuple[str, bool]]:
    """hvdrun's long spellings -> (parameter, which side of an on/off flag)."""
    found: dict[str, tuple[str, bool]] = {}
    for param in cli.get_params(click.Context(cli)):
        for side, spellings in ((True, param.opts), (False, param.secondary_opts)):
            for spelling in spellings:
                if spelling.startswith("--"):
                    found[spelling] = (param.name or "", side)
    return found


@pytest.fixture
def discover(tmp_path: Path) -> str:
    script = tmp_path / "discover.sh"
    # Hosts without slots: each gets --slots-per-host's.
    script.write_text("#!/bin/sh\necho localhost\necho 127.0.0.1\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_horovod_elastic_line_is_accepted_and_the_command_untouched(
    discover: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The line from Horovod's elastic documentation; the script's own options look like
    # hvdrun's (abbreviated and not) and must reach it as they are.
    script_args = ["--slots", "x", "--num-p=3", "--host-disc", "-np", "--log-with", "--", "-v"]
    horovod_line = ["-np", "8", "--host-discovery-script", discover, "--slots", "4"]
    out = plan([*horovod_line, "python", "train.py", *script_args], capsys)
    assert f"command: python train.py {' '.join(script_args)}\n" in out
    assert "elastic: min-np 8," in out
    assert "first discovery (localhost:4, 127.0.0.1:4)" in out  # --slots meant --slots-per-host


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--num-p", "2", "true"], "2 worker(s)"),
        (["--num-p=2", "true"], "2 worker(s)"),
        (["--num-proc=2", "true"], "2 worker(s)"),
        (["-np", "1", "--gloo-t=60", "true"], "HVDRUN_GLOO_TIMEOUT_SECONDS=60"),
        (["-np", "1", "--torus", "true"], "HOROVOD_TORUS_ALLREDUCE=1"),
        (["-np", "1", "--no-hier", "true"], None),  # ambiguous: checked below
        (["-np", "1", "--no-hierarchical-allr", "true"], "HOROVOD_HIERARCHICAL_ALLREDUCE=0"),
        (["-np", "1", "--min-n", "1", "--max-n", "2", "true"], "min-np 1, max-np 2"),
        (["-np", "1", "--start", "7", "true"], "start timeout: 7 s"),
        # hvdrun's own options abbreviate too
        (["-np", "1", "--launch", "local", "true"], "1 worker(s)"),
        (["-np", "1", "--heartbeat=9", "true"], "heartbeat timeout: 9 s"),
    ],
)
def test_abbreviations_mean_the_full_option(
    argv: list[str], expected: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    if expected is None:
        assert_usage_error(argv, "ambiguous option --no-hier", capsys)
        return
    assert expected in plan(argv, capsys)


def test_host_discovery_prefix_with_equals(
    discover: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = plan(["-np", "2", f"--host-disc={discover}", "--slots=1", "true"], capsys)
    assert "first discovery (localhost:1, 127.0.0.1:1)" in out


@pytest.mark.parametrize(
    ("option", "candidates"),
    [
        ("--log-with", "--log-with-timestamp, --log-without-timestamp"),
        ("--ssh-", "--ssh-config-file, --ssh-host-key-policy, --ssh-identity-file, --ssh-port"),
        ("--num", "--num-nccl-streams, --num-proc"),
        ("--stall", "--stall-check, --stall-check-shutdown-time-seconds"),
    ],
)
def test_ambiguous_prefix_lists_the_candidates(
    option: str, candidates: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(
        ["-np", "1", option, "1", "true"], f"ambiguous option {option}: it could be", capsys
    )
    assert_usage_error(["-np", "1", f"{option}=1", "true"], candidates, capsys)


def test_unknown_option_still_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(["-np", "1", "--slotz", "4", "true"], "No such option '--slotz'", capsys)


def test_every_horovodrun_option_is_spelt_out_here() -> None:
    assert set(cli_options()) >= HOROVODRUN_LONG_OPTIONS


def test_every_prefix_horovodrun_resolves_means_the_same_here() -> None:
    """What argparse would do with horovodrun's options: a prefix of exactly one of them is
    that option; hvdrun must read it as the same option, whatever options of its own start
    the same way (``--check`` is --check-build although hvdrun has --check-hosts)."""
    options = cli_options()
    checked = 0
    for name in HOROVODRUN_LONG_OPTIONS:
        for end in range(3, len(name) + 1):
            prefix = name[:end]
            if [other for other in HOROVODRUN_LONG_OPTIONS if other.startswith(prefix)] != [name]:
                continue
            assert options[expand(prefix, options)] == options[name], prefix
            checked += 1
    assert checked > 500  # the loop really ran over horovodrun's prefixes


def test_expand_leaves_single_dash_and_exact_spellings_alone() -> None:
    options = {"--hosts": "hosts", "--hostfile": "hostfile", "-hostfile": "hostfile"}
    assert expand("--hosts", options) == "--hosts"  # exact, though a prefix of --hostfile
    assert expand("-host", options) == "-host"  # single dash: click's short options
    assert expand("--hostf", options) == "--hostfile"
    assert expand("--x", options) == "--x"  # unknown: the parser says "no such option"
    with pytest.raises(click.BadOptionUsage, match="--hostfile, --hosts"):
        expand("--host", options)


def test_check_prefix_is_check_build_as_in_horovodrun(capsys: pytest.CaptureFixture[str]) -> None:
    # Without -np, so that the command line only parses if --check means --check-build.
    code = run_cli(["--check"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Available Frameworks:" in out


def test_single_letter_options_take_a_value_after_equals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse (horovodrun) reads -H=a:2 as -H a:2; the script's own -H=x stays its own.
    key = tmp_path / "key"
    key.write_text("")
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text("")
    argv = ["--ssh-config-file", str(ssh_config), "-H=gpu1.invalid:2", "-p=2222", f"-i={key}"]
    out = plan([*argv, "-x=FOO=bar", "python", "t.py", "-H=x", "-p=1"], capsys)
    assert "command: python t.py -H=x -p=1" in out
    assert f"gpu1.invalid  2 worker(s)  ssh root@gpu1.invalid:2222, key {key}," in out
    assert "  FOO=bar\n" in out


def test_a_flag_given_a_value_after_equals_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(["-v=1", "true"], "Option '-v' does not take a value.", capsys)


@pytest.mark.parametrize(
    ("word", "message"),
    [
        ("-host", "no such option: -host (did you mean -H, --hosts or -hostfile?)"),
        ("-hosts", "no such option: -hosts (did you mean -H or --hosts?)"),
        ("-verbose", "no such option: -verbose (did you mean --verbose?)"),
        ("-num-proc", "no such option: -num-proc (did you mean -n, -np or --num-proc?)"),
        ("-ssh-port", "no such option: -ssh-port (did you mean -p or --ssh-port?)"),
        ("-host=a:1", "no such option: -host (did you mean -H, --hosts or -hostfile?)"),
        # -p takes a port: "ort" is none, so the word was mistyped, not -p's value.
        ("-port", "no such option: -port (did you mean -p, --ssh-port or --no-report?)"),
        ("-zzzz", "no such option: -zzzz\n"),
    ],
)
def test_a_mistyped_single_dash_word_is_named_whole(
    word: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error([word, "2", "python", "w.py"], message, capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--np", "2"], "no such option: --np (mpirun's spelling: hvdrun takes -np N)"),
        (["--oversubscribe"], "no such option: --oversubscribe (an mpirun option: hvdrun "),
        (["--bind-to", "none"], "no such option: --bind-to (an mpirun option: "),
        (
            ["--nproc_per_node=2"],
            "no such option: --nproc_per_node (a torchrun option: hvdrun takes -np N (the "
            "processes of the whole job) and -H host1:N,host2:N",
        ),
        (["--nproc-per-node", "2"], "no such option: --nproc-per-node (a torchrun option: "),
        (["--standalone"], "no such option: --standalone (a torchrun option: "),
    ],
)
def test_another_launchers_option_says_what_to_use_instead(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """mpirun's, srun's and torchrun's options typed out of habit: the error says whose
    option it is and what hvdrun takes, not the nearest spelling (--oversubscribe was
    "did you mean '--verbose'?")."""
    assert_usage_error([*args, "python", "w.py"], message, capsys)


@pytest.mark.parametrize("argv", [["-n", "3"], ["-n3"], ["-n=3"]])
def test_n_is_np_as_argparse_and_mpirun_read_it(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """horovodrun's argparse takes -n as a prefix of -np alone, and -n is mpirun's count."""
    out = plan([*argv, "python", "train.py", "-n", "1"], capsys)
    assert "3 worker(s) on 1 host(s)" in out
    assert "command: python train.py -n 1\n" in out  # (the script's own -n stays its own)


def test_single_dash_spellings_work_and_a_near_miss_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every single-dash spelling that worked still does, combined forms included ...
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    out = plan(["-np", "2", "-hostfile", str(hostfile), "-prefix-timestamp", "true"], capsys)
    assert "2 worker(s) on 1 host(s)" in out
    out = plan(["-np=3", "-Hlocalhost:3", "-xFOO=1", "-x", "BAR=2", "-p2222", "true"], capsys)
    assert "3 worker(s) on 1 host(s)" in out
    assert "  FOO=1\n" in out and "  BAR=2\n" in out
    # ... and one letter off, the error names the word and those spellings.
    assert_usage_error(
        ["-hostfil", str(hostfile), "true"],
        "no such option: -hostfil (did you mean -hostfile, -H or --hosts?)",
        capsys,
    )
