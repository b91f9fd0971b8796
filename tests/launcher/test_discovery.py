"""Host discovery output, the discovery script and the blacklist's cooldown."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.spec.hosts import HostSpec
from launcher.supervision.discovery import (
    Blacklist,
    DiscoveryError,
    ScriptDiscovery,
    parse_discovery_output,
)


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


def test_script_discovery_runs_through_the_shell(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("x:2\ny\n")
    assert ScriptDiscovery(f"cat {hosts}", slots_per_host=3).find() == [
        HostSpec("x", 2),
        HostSpec("y", 3),
    ]
    with pytest.raises(DiscoveryError, match=r"did not finish within 0\.2 s"):
        ScriptDiscovery("sleep 5", timeout=0.2).find()
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
