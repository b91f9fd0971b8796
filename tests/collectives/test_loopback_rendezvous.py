"""A rendezvous name that rank 0's host resolves to loopback (Debian's 127.0.1.1 for the
host's own name) must not point Gloo at ``lo``, nor bind the rendezvous to loopback, when
the job has ranks on other hosts; a job on one host keeps ``lo``."""

from __future__ import annotations

import logging

import pytest

from collectives.runtime import launched
from rendezvous.launchers import Placement, derived_port

IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@pytest.fixture(autouse=True)
def no_ifnames(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*IFNAMES, "HVDRUN_SECRET", "HVDRUN_RENDEZVOUS_PORT"):
        monkeypatch.setenv(name, "")  # (so that what a test sets is undone after it)
        monkeypatch.delenv(name)


@pytest.fixture
def debian_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host's own name, ``node1``, resolves to 127.0.1.1; its default route is eth9."""

    def facing(addr: str) -> tuple[str | None, str | None]:
        host = addr.rpartition(":")[0].strip("[]")
        if host in ("node1", "127.0.1.1"):
            return "lo", "127.0.1.1"
        if host in ("127.0.0.1", "localhost"):
            return "lo", "127.0.0.1"
        return "eth0", "10.0.0.11"

    monkeypatch.setattr(launched, "interface_facing", facing)
    monkeypatch.setattr(launched, "outward_interface", lambda: "eth9")


def placement(**fields: object) -> Placement:
    base: dict[str, object] = {"launcher": "torchrun", "name": "torchrun", "rank": 0, "size": 2}
    base.update(fields)
    return Placement(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("local_size", "spans"), [(None, True), (1, True), (2, False), (4, False)])
def test_a_job_spans_hosts_when_world_size_exceeds_local_world_size(
    local_size: int | None, spans: bool
) -> None:
    assert launched.spans_hosts(placement(local_size=local_size)) is spans
    assert launched.spans_hosts(placement(size=1)) is False


@pytest.mark.usefixtures("debian_hosts")
def test_a_multi_host_job_gets_the_default_routes_interface(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=launched.logger.name):
        assert launched._point_gloo_at("node1:29577", spans=True) == list(IFNAMES)
    assert [launched.os.environ[name] for name in IFNAMES] == ["eth9", "eth9"]
    assert "reached over loopback on this host (127.0.1.1)" in caplog.text
    assert "but the job has ranks on other hosts: Gloo and NCCL use eth9" in caplog.text
    caplog.clear()
    # Without a local size, a job of one host is told apart from one of several by
    # nothing: the warning says that it may span hosts, and how to tell.
    with caplog.at_level(logging.WARNING, logger=launched.logger.name):
        launched._point_gloo_at("node1:29577", list(IFNAMES), spans=True, guessed=True)
    assert (
        "but the job may have ranks on other hosts (the launcher gives no local size; "
        "LOCAL_WORLD_SIZE tells): Gloo and NCCL use eth9"
    ) in caplog.text


@pytest.mark.usefixtures("debian_hosts")
@pytest.mark.parametrize(
    ("addr", "spans"), [("node1:29577", False), ("127.0.0.1:29577", True), ("localhost:1", True)]
)
def test_a_one_host_job_or_a_loopback_address_keeps_lo(
    addr: str, spans: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=launched.logger.name):
        launched._point_gloo_at(addr, spans=spans)
    assert launched.os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert caplog.text == ""


@pytest.mark.usefixtures("debian_hosts")
def test_a_chosen_interface_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    assert launched._point_gloo_at("node1:29577", spans=True) == []
    assert launched.os.environ["GLOO_SOCKET_IFNAME"] == "eth1"


def test_slurm_first_node_resolving_to_loopback_listens_for_the_other_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launched, "node_address", lambda name: "127.0.1.1")
    slurm = placement(
        launcher="slurm", name="Slurm (srun)", first_host="n1", job_key="slurm/9/0", size=4
    )
    meeting = launched.plan_meeting(slurm)
    port = derived_port("slurm/9/0")
    assert (meeting.addr, meeting.bind_host) == (f"n1:{port}", "0.0.0.0")
    alone = launched.plan_meeting(
        placement(
            launcher="slurm", name="Slurm (srun)", first_host="n1", job_key="slurm/9/0",
            size=2, local_size=2,
        )
    )  # fmt: skip
    assert (alone.addr, alone.bind_host) == (f"127.0.1.1:{port}", "127.0.0.1")


def test_the_default_routes_interface_is_found() -> None:
    name = launched.outward_interface()
    assert name is None or name != "lo"
