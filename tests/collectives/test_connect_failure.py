"""A rank whose Gloo cannot connect to its peers says what each side advertised and names
--network-interface (Gloo's error names only the peer's address)."""

from __future__ import annotations

import datetime
import socket

import psutil
import pytest

from collectives.runtime import reach, registration
from collectives.runtime.state import RuntimeState, Topology

GLOO_TEXT = (
    "Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: "
    "Connection timed out, remote=[10.9.51.2]:49055$0"
)
GLOO_ERROR = "hvd.init() could not connect rank 0 to its 1 peers: " + GLOO_TEXT


def test_a_connect_failure_names_both_sides_and_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    name, entries = next(iter(psutil.net_if_addrs().items()))
    address = next(e.address for e in entries if e.family in (socket.AF_INET, socket.AF_INET6))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)
    message = str(reach.connect_failure(0, 2, RuntimeError(GLOO_TEXT)))
    assert message.startswith(GLOO_ERROR + ". This rank advertised " + f"{name} (")
    assert address.split("%")[0] in message
    assert f"on {socket.gethostname()}; the peer(s) it could not reach advertised 10.9.51.2." in (
        message
    )
    assert "hvdrun --network-interface IF" in message


def _bootstrap_failing_with(monkeypatch: pytest.MonkeyPatch, text: str, timeout: float) -> str:
    """hvd.init()'s error on rank 0 of 2 under hvdrun when creating the default group of its
    registered generation raised ``text`` (bootstrap timeout ``timeout``)."""

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError(text)

    monkeypatch.setattr(registration, "init_default_group", fail)
    topology = Topology(rank=0, size=2, local_rank=0, local_size=1, cross_rank=0, cross_size=2)
    runtime_ = RuntimeState(
        topology=topology,
        backend="gloo",
        timeout=datetime.timedelta(seconds=timeout),
        store=None,
        client=object(),
    )
    with pytest.raises(RuntimeError) as raised:
        registration._bootstrap(runtime_, 1)
    return str(raised.value)


def test_hvd_init_under_hvdrun_explains_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default group of a registered generation fails to connect (Gloo's error).
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    message = _bootstrap_failing_with(monkeypatch, GLOO_TEXT, 5)
    assert "This rank advertised the address of its host name" in message


def test_a_superseded_generation_is_not_called_a_network_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Elastic jobs: hosts joined or left while a generation bootstrapped, and the server
    refused its keys (torch's error around the store call's). That is routine, not the
    network: the error stays the server's, without advice on interfaces."""
    text = (
        "rendezvous Get of 'hvdrun/g3/i1/rank_1' failed: ABORTED: membership generation 3 "
        "was superseded by generation 4 (hosts joined or left the job)"
    )
    assert _bootstrap_failing_with(monkeypatch, text, 5) == text


def test_joining_the_generation_that_superseded_one_logs_no_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank whose generation was superseded joins the next one; only a real failure to
    join is a warning (every rank of every turnover of hosts printed one)."""
    errors = [
        RuntimeError("ABORTED: membership generation 3 was superseded by generation 4 (...)"),
        RuntimeError("Gloo connectFullMesh failed"),
    ]

    def bootstrap(runtime_: RuntimeState, counter: int) -> None:
        if errors:
            raise errors.pop(0)

    def register(runtime_: RuntimeState, generation: int) -> None:
        runtime_.generation = generation

    monkeypatch.setattr(registration, "_bootstrap", bootstrap)
    monkeypatch.setattr(registration, "start_engine", lambda runtime_: "engine")
    monkeypatch.setattr(registration, "destroy_groups", lambda: None)
    monkeypatch.setattr(registration, "register", register)
    topology = Topology(rank=1, size=2, local_rank=0, local_size=1, cross_rank=1, cross_size=2)
    runtime_ = RuntimeState(
        topology=topology, backend="gloo", timeout=datetime.timedelta(seconds=5), store=None
    )
    runtime_.generation = 3
    with caplog.at_level("INFO", logger="collectives"):
        registration.join_elastic(runtime_)
    assert runtime_.engine == "engine" and runtime_.generation == 5
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        (
            "INFO",
            "rank 1: generation 3 was superseded by generation 4 (hosts joined or left the "
            "job); joining that one",
        ),
        (
            "WARNING",
            "rank 1 could not join generation 4 (Gloo connectFullMesh failed); waiting for "
            "the next one",
        ),
    ], said


def test_a_peer_that_never_called_init_is_named_not_the_network(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 never reached hvd.init(): its address never came, and rank 0's bootstrap
    timed out waiting for that key. The error names rank 1 and hvd.init(); the advice on
    network interfaces (for peers whose addresses came but cannot be reached) is not given."""
    text = (
        "rendezvous store (prefix 'hvdrun/g0/i1/'): rendezvous get('hvdrun/g0/i1/0//cpu//0/1') "
        "at 127.0.0.1:43127 failed: key 'hvdrun/g0/i1/0//cpu//0/1' was not set within 300 s"
    )
    message = _bootstrap_failing_with(monkeypatch, text, 300)
    assert message.startswith(
        "hvd.init() on rank 0 waited 300 s for rank 1, which never joined the job: rank 1 has "
        "not called hvd.init(), or failed before it."
    ), message
    assert "network-interface" not in message and "GLOO_SOCKET_IFNAME" not in message


@pytest.mark.parametrize("text", ["Resource temporarily unavailable", "can't start new thread"])
def test_a_rank_out_of_threads_is_told_of_the_limits_not_the_network(text: str) -> None:
    # (a container's pids limit, ulimit -u or -v: Gloo's EAGAIN read as "could not connect
    # rank 1 to its 1 peers ... choose an interface")
    message = str(reach.connect_failure(1, 2, RuntimeError(text)))
    assert message.startswith(f"hvd.init() could not start the threads it needs ({text}): ")
    assert "ulimit -u" in message and "ulimit -v" in message
    assert "--network-interface" not in message
    assert reach.out_of_threads(RuntimeError(GLOO_TEXT)) is None


def test_hvd_init_out_of_threads_says_which_limits(
    alone: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import collectives.torch as hvd
    from collectives.runtime import bootstrap

    def no_thread(*args: object) -> None:
        raise RuntimeError("can't start new thread")  # (what threading says at the limit)

    monkeypatch.setattr(bootstrap, "start_engine", no_thread)
    with pytest.raises(RuntimeError, match=r"^hvd.init\(\) could not start the threads it needs"):
        hvd.init()
    assert not hvd.is_initialized()
