"""A host with several interfaces gives Gloo and NCCL the one its routes to most of the
job's other hosts use (the rendezvous may face another one: the launcher's own network)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launcher.agent import probe, session
from launcher.check_hosts import HostReport
from launcher.transport.protocol import (
    AgentSpec,
    Network,
    PrepareRequest,
    decode_request,
    encode_request,
)
from launcher.transport.startup import RendezvousPlan, host_addresses, member_peers
from rendezvous import addresses

#: This host: eth1 faces the launcher only (10.9.0.0/24), eth0 the other hosts (10.1.0.0/24).
ROUTES = {"10.9.0.1": "10.9.0.2", "10.1.0.11": "10.1.0.12", "10.1.0.13": "10.1.0.12"}
INTERFACES = {"10.9.0.2": "eth1", "10.1.0.12": "eth0"}


@pytest.fixture
def two_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    def facing(addr: str) -> tuple[str | None, str | None]:
        local = ROUTES.get(addr.rpartition(":")[0])
        return (INTERFACES[local], local) if local else (None, None)

    for module in (session, addresses, probe):
        monkeypatch.setattr(module, "interface_facing", facing)
    monkeypatch.setattr(addresses, "source_address", lambda host: ROUTES.get(host))
    monkeypatch.setattr(addresses, "interface_of", lambda address: INTERFACES.get(address))


@pytest.mark.usefixtures("two_interfaces")
@pytest.mark.parametrize(
    ("peers", "ifname"),
    [
        (["10.1.0.11", "10.1.0.13"], "eth0"),  # the peers' network, not the launcher's
        (["10.1.0.11", "192.0.2.9"], "eth0"),  # an unroutable peer does not count
        (["10.9.0.1", "10.1.0.11"], "eth1"),  # a tie: the rendezvous-facing one
        (["192.0.2.9"], "eth1"),  # no routable peer: the rendezvous-facing one
        ([], "eth1"),
    ],
)
def test_the_interface_facing_most_peers_wins(peers: list[str], ifname: str) -> None:
    env: dict[str, str] = {}
    events: list[object] = []
    session.network_env(env, "10.9.0.1:4000", events.append, peers)
    assert env == {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}
    address = {"eth0": "10.1.0.12", "eth1": "10.9.0.2"}[ifname]
    assert events == [Network(ifname, address)]


@pytest.mark.usefixtures("two_interfaces")
@pytest.mark.parametrize(
    ("peers", "address"),
    [
        (("10.1.0.11", "10.1.0.13"), "10.1.0.12"),  # where the other hosts can dial it
        (("192.0.2.9",), "10.9.0.2"),  # none routable: the rendezvous-facing address
        ((), "10.9.0.2"),
    ],
)
def test_master_addr_of_plain_torch_scripts_faces_most_peers(
    peers: tuple[str, ...], address: str
) -> None:
    """MASTER_ADDR on rank 0's host is the address of the interface Gloo and NCCL get
    there: a plain DDP script's ranks on the other hosts dial it."""
    request = decode_request(encode_request(PrepareRequest("10.9.0.1:4000", peers)))
    assert request == PrepareRequest("10.9.0.1:4000", peers)
    picked, port = addresses.pick_master(request.rendezvous_addr, lambda: "x", request.peers)
    assert picked == address and 0 < port < 65536


@pytest.mark.usefixtures("two_interfaces")
def test_check_hosts_shows_the_interface_a_job_would_use() -> None:
    """--check-hosts' INTERFACE column: Gloo's interface where it is not the one facing
    hvdrun (as the agents of a job choose), with the hvdrun-facing one beside it."""
    peers = ["10.1.0.11", "10.1.0.13"]
    facts = probe.network_facts("10.9.0.1:4000", peers)
    assert facts == {
        "ifname": "eth1",
        "address": "10.9.0.2",
        "gloo_ifname": "eth0",
        "gloo_address": "10.1.0.12",
    }
    assert HostReport("n2", facts).cells()["INTERFACE"] == "eth0 10.1.0.12 (hvdrun: eth1)"
    alone = probe.network_facts("10.9.0.1:4000", [])
    assert alone == {"ifname": "eth1", "address": "10.9.0.2"}
    assert HostReport("n2", alone).cells()["INTERFACE"] == "eth1 10.9.0.2"


@pytest.mark.usefixtures("two_interfaces")
def test_network_interface_still_wins() -> None:
    env = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    session.network_env(env, "10.9.0.1:4000", lambda event: None, ["10.1.0.11"])
    assert env == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}


def test_the_launcher_tells_each_agent_its_peers_addresses() -> None:
    agents = [
        SimpleNamespace(hostname="localhost", kind="local"),
        SimpleNamespace(hostname="n1", kind="ssh", target=SimpleNamespace(hostname="10.1.0.11")),
        SimpleNamespace(hostname="n2", kind="ssh", target=SimpleNamespace(hostname="10.9.0.2")),
        SimpleNamespace(hostname="n3", kind="ssh", target=SimpleNamespace(hostname="127.0.0.1")),
    ]
    plan = RendezvousPlan("0.0.0.0", 0, {"localhost": "10.1.0.1", "n1": "10.1.0.1"})
    assert host_addresses(agents, plan.addr_host) == {  # type: ignore[arg-type]
        "localhost": "10.1.0.1",
        "n1": "10.1.0.11",
        "n2": "10.9.0.2",
    }
    spec = AgentSpec("n1", ["true"], "/", {}, peers=["10.1.0.1", "10.9.0.2"])
    assert AgentSpec.from_dict(spec.to_dict()) == spec


def test_an_elastic_generations_hosts_are_each_others_peers() -> None:
    """Each host of an elastic job's generation is told the others' addresses as this
    machine reaches them; this machine's own is where its workers dial the rendezvous."""

    def remote(name: str, target: str, local: str) -> SimpleNamespace:
        return SimpleNamespace(
            hostname=name, kind="ssh", target=SimpleNamespace(hostname=target), local_address=local
        )

    here = SimpleNamespace(hostname="localhost", kind="local")
    n1, n2 = remote("n1", "10.1.0.11", "10.1.0.1"), remote("n2", "10.9.0.2", "10.9.0.1")
    members = [here, n1, n2]
    assert member_peers(n1, members, None) == ["10.1.0.1", "10.9.0.2"]  # type: ignore[arg-type]
    assert member_peers(here, members, None) == ["10.1.0.11", "10.9.0.2"]  # type: ignore[arg-type]
    assert member_peers(n2, members, "10.5.0.1:4000") == ["10.5.0.1", "10.1.0.11"]  # type: ignore[arg-type]
    assert member_peers(n2, members, "127.0.0.1") == ["10.1.0.11"]  # type: ignore[arg-type]
    assert member_peers(n1, [n1], None) == []  # type: ignore[arg-type]
