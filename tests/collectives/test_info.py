"""``python -m collectives.torch.info``: what hvd.init() would do, said in sentences."""

from __future__ import annotations

import pytest

from collectives.runtime import launched
from collectives.torch import info

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "job7",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29400",
}


@pytest.fixture
def environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        "HVDRUN_RENDEZVOUS_ADDR",
        "HVDRUN_SECRET",
        "HVDRUN_LAUNCHER",
        "OMPI_COMM_WORLD_RANK",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_where_the_ranks_meet_reads_as_a_sentence(environment: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN.items():
        environment.setenv(name, value)
    lines = info.report()
    assert (
        "rendezvous: served by rank 0; the ranks meet at the address rank 0 publishes in "
        "torchrun's store at 127.0.0.1:29400"
    ) in lines, lines
    environment.delenv("TORCHELASTIC_RUN_ID")  # (a Kubernetes PyTorchJob's variables)
    assert (
        "rendezvous: served by rank 0; the ranks meet at MASTER_ADDR=127.0.0.1 and port 29400 "
        "(MASTER_PORT)"
    ) in info.report()


def test_the_unauthenticated_warning_says_how_this_launcher_passes_a_secret_on(
    environment: pytest.MonkeyPatch,
) -> None:
    for name, value in TORCHRUN.items():
        environment.setenv(name, value)
    placement = launched.detect_placement()
    assert placement is not None
    text = launched.unauthenticated_warning(placement, launched.plan_meeting(placement))
    assert text.startswith("hvd.init(): this job's rendezvous is not authenticated"), text
    assert "(torchrun passes it on)" in text and "srun" not in text, text
