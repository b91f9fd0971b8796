"""Host discovery output, the discovery script and the blacklist's cooldown."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from launcher.spec.hosts import HostSpec
from launcher.supervision.discovery import (
    Blacklist,
    DiscoveryError,
    ScriptDiscovery,
    parse_discovery_output,
)
from tests.processes import assert_gone


def test_parse_discovery_output() -> None:
    text = "# hosts\nnode-a\nnode-b:4  # big one\n\n10.0.0.7:2\n"
    assert parse_discovery_output(text, slots_per_host=2) == [
        HostSpec("node-a", 2),
        HostSpec("node-b", 4),
        HostSpec("10.0.0.7", 2),
    ]
    assert parse_discovery_output("", 1) == []
    with pytest.raises(DiscoveryError, match="line 2: slot count in 'b:0' must be at least 1"):
        parse_discovery_output("a\nb:0\n", 1)


def test_discovery_output_with_ipv6_addresses() -> None:
    text = "fd00::2\n[fd00::3]\n[fd00::4]:4\n"
    assert parse_discovery_output(text, slots_per_host=2) == [
        HostSpec("fd00::2", 2),
        HostSpec("fd00::3", 2),
        HostSpec("fd00::4", 4),
    ]
    with pytest.raises(DiscoveryError, match=r"line 1: 'fd00::1:2' is ambiguous"):
        parse_discovery_output("fd00::1:2\n", 1)


def test_a_host_printed_twice_takes_its_last_lines_slots() -> None:
    """As in Horovod, which keeps the hosts in a dict: the last line wins."""
    repeated: set[str] = set()
    text = "a:2\nb\na:4\nc:1\nb:3\n"
    assert parse_discovery_output(text, 1, repeated) == [
        HostSpec("a", 4),
        HostSpec("b", 3),
        HostSpec("c", 1),
    ]
    assert repeated == {"a", "b"}
    assert parse_discovery_output("a\na\n", 2) == [HostSpec("a", 2)]


def test_script_discovery_warns_once_about_a_host_printed_twice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    discovery = ScriptDiscovery("printf 'x:1\\ny:1\\nx:5\\n'")
    with caplog.at_level("WARNING", logger="launcher.supervision.discovery"):
        assert discovery.find() == [HostSpec("x", 5), HostSpec("y", 1)]
        assert discovery.find() == [HostSpec("x", 5), HostSpec("y", 1)]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "host discovery script \"printf 'x:1\\\\ny:1\\\\nx:5\\\\n'\" prints host x more "
        "than once: its last line counts (5 slot(s))"
    ]


def test_script_discovery_runs_through_the_shell(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("x:2\ny\n")
    assert ScriptDiscovery(f"cat {hosts}", slots_per_host=3).find() == [
        HostSpec("x", 2),
        HostSpec("y", 3),
    ]
    with pytest.raises(DiscoveryError, match=r"did not finish within 0\.2 s"):
        ScriptDiscovery("sleep 5", timeout=0.2).find()
    with pytest.raises(DiscoveryError, match="exited, but a process it started still held"):
        ScriptDiscovery(f"cat {hosts}; sleep 5 &", timeout=0.5).find()
    with pytest.raises(DiscoveryError, match="exited with code 127"):
        ScriptDiscovery(str(tmp_path / "missing.sh")).find()


def test_blacklist_cooldown_grows_exponentially_up_to_the_maximum() -> None:
    forever = Blacklist()
    assert forever.add("a", now=0.0) is None
    assert forever.blocked("a", now=1e9)
    assert not forever.blocked("b", now=0.0)
    cooling = Blacklist(cooldown=(1.0, 5.0))
    assert [cooling.add("a", now=0.0) for _ in range(4)] == [1.0, 2.0, 4.0, 5.0]
    assert cooling.blocked("a", now=4.9)
    assert not cooling.blocked("a", now=5.0)
    assert cooling.failures("a") == 4


def _started(pidfile: Path) -> int:
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline, "the discovery script never started"
        time.sleep(0.02)
    return int(pidfile.read_text())


def test_stop_ends_the_run_under_way_and_every_later_one(tmp_path: Path) -> None:
    """The job is over while a run waits on its scheduler: stop() ends it at once (and what
    it started); no run starts after it."""
    pidfile = tmp_path / "pid"
    discovery = ScriptDiscovery(f"echo $$ > {pidfile}; sleep 60; echo late")
    failed: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(discovery.find, failed))
    thread.start()
    pid = _started(pidfile)
    discovery.stop()
    thread.join(5)
    assert not thread.is_alive()
    assert_gone([pid], within=5)
    assert isinstance(failed[0], DiscoveryError), failed
    with pytest.raises(DiscoveryError, match="the job is over"):
        discovery.find()


def test_an_interrupted_run_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while hvdrun waits for the first run (a session of its own, which the
    terminal's SIGINT does not reach) ends the run too."""
    pidfile = tmp_path / "pid"

    def interrupted(self: subprocess.Popen[bytes], timeout: float | None = None) -> None:
        _started(pidfile)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ScriptDiscovery(f"echo $$ > {pidfile}; sleep 60").find()
    assert_gone([int(pidfile.read_text())], within=5)


def _catch(call: Callable[[], object], into: list[BaseException]) -> None:
    try:
        call()
    except BaseException as error:
        into.append(error)
