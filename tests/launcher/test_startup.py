"""Starting agents: version checks, rendezvous addresses, the start timeout, error text."""

from __future__ import annotations

import time
from typing import Any

import pytest

from launcher.spec.hosts import local_addresses
from launcher.spec.options import LaunchOptions
from launcher.transport import startup
from launcher.transport.connection import AgentConnection, AgentStartError
from launcher.transport.protocol import PROTOCOL_VERSION, Hello
from launcher.transport.startup import (
    LaunchError,
    dial_host,
    open_agents,
    plan_rendezvous,
    rendezvous_addr,
    shared_machines,
    version_problems,
)
from rendezvous.addresses import is_loopback

HERE = {"python": "3.11.7", "hvdrun": "0.1.0", "torch": "2.13.0+cpu"}


class FakeAgent(AgentConnection):
    def __init__(
        self,
        hostname: str,
        kind: str = "ssh",
        local_address: str | None = None,
        hello: dict[str, Any] | None = None,
        start_delay: float = 0.0,
        error: str | None = None,
    ) -> None:
        super().__init__(hostname, "/usr/bin/python3", "/")
        self.kind = kind
        self.local_address = local_address
        self._hello = hello
        self._delay = start_delay
        self._error = error
        self.aborted = False

    def start(self, deadline: float) -> None:
        self.stage = "in the SSH handshake"
        time.sleep(self._delay)
        if self._error:
            raise AgentStartError(self._error)
        raw = self._hello or {
            "protocol": PROTOCOL_VERSION,
            **HERE,
            "executable": "/usr/bin/python3",
        }
        self.hello = Hello(**raw)

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        pass


def hello(**changes: Any) -> dict[str, Any]:
    return {"protocol": PROTOCOL_VERSION, **HERE, "executable": "/opt/py/bin/python", **changes}


def test_versions_that_differ_are_named() -> None:
    agents = [
        FakeAgent("same", hello=hello()),
        FakeAgent("other-cuda-build", hello=hello(torch="2.13.0+cu128", python="3.11.2")),
        FakeAgent("old-torch", hello=hello(torch="2.12.1")),
        FakeAgent("no-torch", hello=hello(torch=None)),
        FakeAgent("py310", hello=hello(python="3.10.14", hvdrun="0.0.9")),
        FakeAgent("ancient", hello=hello(protocol=0)),
    ]
    for agent in agents:
        agent.start(0)
    problems = version_problems(HERE, agents)
    assert set(problems) == {"old-torch", "no-torch", "py310", "ancient"}
    assert problems["old-torch"] == (
        "/opt/py/bin/python has torch 2.12.1 (here 2.13.0+cpu): install the same versions on "
        "every host, or pass --skip-version-check"
    )
    assert "torch not installed (here 2.13.0+cpu)" in problems["no-torch"]
    assert "Python 3.10.14 (here 3.11.7), hvdrun 0.0.9 (here 0.1.0)" in problems["py310"]
    assert "speaks protocol 0" in problems["ancient"]


def test_one_machine_under_two_names_is_noted() -> None:
    # (-H node1:1,10.0.0.11:1: both workers take local rank 0, the same GPU, and all cores)
    agents = [
        FakeAgent("node1", hello=hello(hostname="n1.cluster")),
        FakeAgent("10.0.0.11", hello=hello(hostname="n1.cluster")),
        FakeAgent("node2", hello=hello(hostname="n2.cluster")),
        FakeAgent("localhost", kind="local", hello=hello(hostname="here")),
        FakeAgent("127.0.0.1", kind="local", hello=hello(hostname="here")),  # (noted already)
    ]
    for agent in agents:
        agent.start(0)
    assert shared_machines(agents) == [
        "hosts node1, 10.0.0.11 are one machine (n1.cluster, as their agents say): their "
        "workers run as if on separate hosts, each host's first worker with local rank 0 (the "
        "same GPU) and each given all the machine's cores; list the machine once, with all "
        "its slots"
    ]


def test_local_only_jobs_use_loopback() -> None:
    plan = plan_rendezvous([FakeAgent("localhost", kind="local")], None)
    assert (plan.bind_host, plan.port) == ("127.0.0.1", 0)
    assert rendezvous_addr(plan, "localhost", 1234) == "127.0.0.1:1234"


def test_each_remote_host_dials_its_own_connections_address() -> None:
    agents = [
        FakeAgent("me", kind="local"),
        FakeAgent("a", local_address="10.0.0.1"),
        FakeAgent("b", local_address="192.168.5.1"),
    ]
    plan = plan_rendezvous(agents, None)
    assert plan.bind_host == "0.0.0.0"
    assert plan.addr_host == {"a": "10.0.0.1", "b": "192.168.5.1", "me": "10.0.0.1"}
    v6 = plan_rendezvous([FakeAgent("c", local_address="fd00::1")], None)
    assert v6.bind_host == "::"
    assert rendezvous_addr(v6, "c", 80) == "[fd00::1]:80"


def test_a_host_that_joins_later_dials_as_the_plan_would() -> None:
    local, remote = FakeAgent("me", kind="local"), FakeAgent("a", local_address="10.0.0.1")
    assert dial_host(remote, [local, remote], None) == "10.0.0.1"
    assert dial_host(local, [local, remote], None) == "10.0.0.1"  # local faces the remotes
    assert dial_host(local, [local], None) == "127.0.0.1"
    assert dial_host(local, [local, remote], "203.0.113.5:29500") == "203.0.113.5"


def test_explicit_rendezvous_address_and_port() -> None:
    agents = [FakeAgent("a", local_address="10.0.0.1"), FakeAgent("me", kind="local")]
    plan = plan_rendezvous(agents, "203.0.113.5:29500")
    assert (plan.bind_host, plan.port) == ("0.0.0.0", 29500)
    assert set(plan.addr_host.values()) == {"203.0.113.5"}
    assert plan_rendezvous(agents, "head-node").port == 0
    assert plan_rendezvous(agents, "[fd00::2]:7").addr_host["a"] == "fd00::2"
    assert plan_rendezvous(agents, "127.0.0.1:9").bind_host == "127.0.0.1"


def test_the_server_listens_only_at_the_one_address_of_this_machine_every_host_dials() -> None:
    # (no network but the one the hosts use reaches the port: a TLS port is still a port)
    mine = next((a for a in local_addresses() if ":" not in a and not is_loopback(a)), None)
    if mine is None:
        pytest.skip("this machine has no IPv4 address but loopback")
    agents = [FakeAgent("a", local_address=mine), FakeAgent("me", kind="local")]
    assert plan_rendezvous(agents, None).bind_host == mine
    assert plan_rendezvous(agents, f"{mine}:29500").bind_host == mine
    # a name, or an address this machine does not have (NAT): every interface
    assert plan_rendezvous(agents, "head-node").bind_host == "0.0.0.0"
    two = [*agents, FakeAgent("b", local_address="192.0.2.77")]
    assert plan_rendezvous(two, None).bind_host == "0.0.0.0"


def test_a_link_local_address_every_host_dials_is_not_bound_without_its_zone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (Linux refuses to bind fe80::... without the interface's zone, which is lost here)
    monkeypatch.setattr(startup, "local_addresses", lambda: {"fe80::fc:ff:fe00:1"})
    agents = [FakeAgent("a", local_address="fe80::fc:ff:fe00:1")]
    assert plan_rendezvous(agents, None).bind_host == "::"


def test_proxied_host_whose_name_does_not_route_needs_rendezvous_addr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Target:
        hostname = "behind-the-bastion"

    monkeypatch.setattr(startup, "source_address", lambda host: None)  # does not resolve here
    agent = FakeAgent("hidden")
    agent.target = Target()  # type: ignore[attr-defined]
    with pytest.raises(LaunchError, match="pass --rendezvous-addr"):
        plan_rendezvous([agent], None)


def test_open_agents_reports_every_failure_and_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = {
        "good": FakeAgent("good"),
        "refused": FakeAgent("refused", error="connection refused by 10.0.0.9 port 22"),
        "slow": FakeAgent("slow", start_delay=5),
    }
    monkeypatch.setattr(startup, "make_agent", lambda name, *args: fakes[name])
    seen: list[tuple[int, int]] = []
    begin = time.monotonic()
    agents, failures, signum = open_agents(
        ["good", "refused", "slow"],
        "/",
        {},
        LaunchOptions(start_timeout=0.5),
        progress=lambda done, total: seen.append((done, total)),
    )
    assert time.monotonic() - begin < 2
    assert list(agents) == ["good"]
    assert failures == {
        "refused": "connection refused by 10.0.0.9 port 22",
        "slow": "timed out after 0.5 s in the SSH handshake",
    }
    assert signum is None
    assert fakes["slow"].aborted
    assert seen[-1] == (1, 3)


def test_a_start_that_ran_out_of_time_says_how_to_raise_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fakes = {
        "refused": FakeAgent("refused", error="connection refused by 10.0.0.9 port 22"),
        "slow": FakeAgent("slow", start_delay=5),
    }
    monkeypatch.setattr(startup, "make_agent", lambda name, *args: fakes[name])
    with pytest.raises(LaunchError) as caught:
        startup.start_agents(["refused", "slow"], "/", {}, LaunchOptions(start_timeout=0.3))
    assert str(caught.value).endswith(
        "  slow     timed out after 0.3 s in the SSH handshake\n"
        "the start timeout (0.3 s) ran out: give the hosts longer with --start-timeout SECONDS "
        "(or HOROVOD_START_TIMEOUT=SECONDS)"
    )
    # A host that failed at once leaves the timeout out of it.
    with pytest.raises(LaunchError) as caught:
        startup.start_agents(["refused"], "/", {}, LaunchOptions(start_timeout=30))
    assert "start timeout" not in str(caught.value)


def test_launch_error_lists_hosts_aligned() -> None:
    error = LaunchError({"n1": "connection refused", "node-22": "timed out"}, 4)
    assert str(error) == (
        "could not start the job on 2 of 4 host(s):\n"
        "  n1       connection refused\n"
        "  node-22  timed out"
    )


def test_interrupt_while_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(startup, "make_agent", lambda name, *args: FakeAgent(name, start_delay=5))
    with pytest.raises(startup.LaunchInterrupted):
        startup.start_agents(["a"], "/", {}, LaunchOptions(), interrupted=lambda: 2)


def test_srun_missing_inside_an_allocation_names_the_ssh_way(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A container inside an allocation often has no srun: the error says how to go on."""
    from launcher.transport.srun import SlurmStep

    monkeypatch.setenv("PATH", str(tmp_path))  # (an empty directory: no srun)
    step = SlurmStep(["node1", "node2"], "/venv/bin/python", "/", heartbeat_timeout=30)
    with pytest.raises(AgentStartError) as caught:
        step.start()
    assert "srun is not on PATH here" in str(caught.value)
    assert "--launcher ssh" in str(caught.value)
