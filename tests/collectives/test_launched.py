"""Where the ranks of a job another launcher started meet (runtime.launched), unit by unit;
the real launchers run in test_other_launchers.py."""

from __future__ import annotations

import pytest

from collectives.runtime import launched
from rendezvous.launchers import Placement, derived_port
from rendezvous.tls import authority_from_secret


@pytest.fixture(autouse=True)
def no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HVDRUN_SECRET", "HVDRUN_RENDEZVOUS_PORT", "HOROVOD_RENDEZVOUS_PORT"):
        monkeypatch.delenv(name, raising=False)


def placement(**fields: object) -> Placement:
    base: dict[str, object] = {"launcher": "torchrun", "name": "torchrun", "rank": 1, "size": 2}
    base.update(fields)
    return Placement(**base)  # type: ignore[arg-type]


def test_master_addr_and_port() -> None:
    meeting = launched.plan_meeting(
        placement(master_addr="10.1.2.3", master_port=2345, job_key="k")
    )
    assert (meeting.addr, meeting.bind_host, meeting.port) == ("10.1.2.3:2345", "0.0.0.0", 2345)
    assert meeting.unauthenticated
    assert meeting.secret.startswith("job-token-")
    assert meeting.how == "MASTER_ADDR=10.1.2.3 and port 2345 (MASTER_PORT)"


def test_loopback_master_binds_loopback_and_ipv6_brackets() -> None:
    local = launched.plan_meeting(placement(master_addr="127.0.0.1", master_port=5))
    assert local.bind_host == "127.0.0.1"
    v6 = launched.plan_meeting(placement(master_addr="fd00::1", master_port=5))
    assert (v6.addr, v6.bind_host) == ("[fd00::1]:5", "::")


def test_secret_and_port_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HVDRUN_SECRET", "s3cret")
    monkeypatch.setenv("HVDRUN_RENDEZVOUS_PORT", "4444")
    meeting = launched.plan_meeting(placement(master_addr="h", master_port=2345))
    assert (meeting.secret, meeting.unauthenticated, meeting.port) == ("s3cret", False, 4444)
    assert "(HVDRUN_RENDEZVOUS_PORT)" in meeting.how


def test_bad_port_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HVDRUN_RENDEZVOUS_PORT", "70000")
    with pytest.raises(launched.JoinError, match="HVDRUN_RENDEZVOUS_PORT must be a port number"):
        launched.plan_meeting(placement(master_addr="h"))


def test_master_addr_without_port_derives_one() -> None:
    meeting = launched.plan_meeting(placement(master_addr="h", job_key="ompi/7"))
    assert meeting.port == derived_port("ompi/7")
    assert "derived from the job id" in meeting.how


def test_every_rank_of_a_job_derives_the_same_token_and_job_id() -> None:
    a = launched.plan_meeting(placement(master_addr="h", master_port=1, job_key="slurm/5/0"))
    b = launched.plan_meeting(
        placement(rank=0, master_addr="h", master_port=1, job_key="slurm/5/0")
    )
    c = launched.plan_meeting(placement(master_addr="h", master_port=1, job_key="slurm/6/0"))
    assert (a.secret, a.job_id) == (b.secret, b.job_id)
    assert a.secret != c.secret and a.job_id != c.job_id


def test_slurm_first_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launched, "node_address", lambda name: {"n1": "10.0.0.11"}.get(name))
    slurm = placement(launcher="slurm", name="Slurm (srun)", first_host="n1", job_key="slurm/9/0")
    meeting = launched.plan_meeting(slurm)
    assert meeting.addr == f"10.0.0.11:{derived_port('slurm/9/0')}"
    lost = placement(launcher="slurm", name="Slurm (srun)", first_host="n9", job_key="x")
    with pytest.raises(launched.JoinError, match=r"the address of n9, the step's first node"):
        launched.plan_meeting(lost)


def test_no_address_for_jsrun() -> None:
    with pytest.raises(launched.JoinError, match="started by LSF \\(jsrun\\) as rank 1 of 2"):
        launched.plan_meeting(placement(launcher="jsrun", name="LSF (jsrun)"))


def test_mpi_without_master_addr_is_settled_over_mpi() -> None:
    meeting = launched.plan_meeting(placement(launcher="mpi", name="Open MPI (mpirun)"))
    assert meeting.addr == "" and meeting.how == "sent by rank 0 over MPI"


def test_choose_address() -> None:
    mine = ["192.168.1.5/24", "10.213.0.11/24"]
    peers = [["10.213.0.12/24"], ["10.213.0.13/24", "172.17.0.2/16"]]
    assert launched.choose_address(mine, peers) == "10.213.0.11"
    assert launched.choose_address(mine, [mine, mine]) == "127.0.0.1"  # one host
    assert launched.choose_address([], [["10.0.0.2/8"]]) == "127.0.0.1"


def test_batch_script_without_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "SLURM_JOB_ID": "12",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_PROCID": "0",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(launched.JoinError, match="Slurm batch script of job 12 \\(4 tasks on 2"):
        launched.detect_placement()
    monkeypatch.setenv("HVDRUN_LAUNCHER", "none")
    assert launched.detect_placement() is None


def test_tls_where_other_hosts_reach_rank_0_and_the_ranks_share_a_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A token derived from the job id protects nothing a certificate could: plain gRPC.
    assert launched.plan_meeting(placement(master_addr="10.1.2.3")).authority() is None
    monkeypatch.setenv("HVDRUN_SECRET", "s3cret")
    # On loopback every rank is on rank 0's host: nothing crosses a network.
    assert launched.plan_meeting(placement(master_addr="127.0.0.1")).authority() is None
    ranks = [launched.plan_meeting(placement(rank=r, master_addr="10.1.2.3")) for r in (0, 1)]
    authorities = []
    for meeting in ranks:  # (each rank derives it in its own process: no cached copy)
        authority_from_secret.cache_clear()
        authorities.append(meeting.authority())
    assert None not in authorities
    keys = {a.key.private_numbers().private_value for a in authorities if a is not None}
    assert len(keys) == 1  # every rank derives the same authority
    monkeypatch.setenv("HVDRUN_SECRET", "another")
    other = launched.plan_meeting(placement(master_addr="10.1.2.3")).authority()
    assert other is not None and other.key.private_numbers().private_value not in keys
