"""--check-hosts' table and its verdict, from host reports (the real thing: test_ssh.py)."""

import re

from launcher.check_hosts import HostReport, disagreements, format_table

FACTS = {
    "python": "3.11.7",
    "torch": "2.13.0+cu128",
    "hvdrun": "0.1.0",
    "gpus": ["NVIDIA H100 80GB HBM3"] * 8,
    "nccl": "2.27.3",
    "ifname": "ens5",
    "address": "10.0.0.11",
}


def test_table_and_disagreements() -> None:
    reports = [
        HostReport("gpu1", dict(FACTS)),
        HostReport("gpu2", {**FACTS, "nccl": "2.26.2", "gpus": ["NVIDIA H100 80GB HBM3"] * 4}),
        HostReport("gpu3", problems=["connection refused by 10.0.0.13 port 22"]),
    ]
    table = format_table(reports)
    assert [re.split(r"\s{2,}", line) for line in table] == [
        ["HOST", "STATUS", "PYTHON", "TORCH", "HVDRUN", "GPUS", "NCCL", "INTERFACE"],
        [
            "gpu1",
            "ok",
            "3.11.7",
            "2.13.0+cu128",
            "0.1.0",
            "8 x H100 80GB HBM3",
            "2.27.3",
            "ens5 10.0.0.11",
        ],
        [
            "gpu2",
            "ok",
            "3.11.7",
            "2.13.0+cu128",
            "0.1.0",
            "4 x H100 80GB HBM3",
            "2.26.2",
            "ens5 10.0.0.11",
        ],
        ["gpu3", "UNUSABLE", "-", "-", "-", "-", "-", "-"],
    ]
    columns = [line.index("0.1.0") for line in table[1:3]]
    assert columns == [table[0].index("HVDRUN")] * 2  # aligned
    assert disagreements(reports) == [
        "hosts disagree on gpus: 8 x H100 80GB HBM3 on gpu1; 4 x H100 80GB HBM3 on gpu2",
        "hosts disagree on nccl: 2.27.3 on gpu1; 2.26.2 on gpu2",
    ]
    assert [r.usable for r in reports] == [True, True, False]


def test_missing_torch_shows_as_missing() -> None:
    report = HostReport("cpu1", {"python": "3.11.7", "hvdrun": "0.1.0", "gpus": None})
    assert report.cells()["TORCH"] == "missing"
    assert report.cells()["GPUS"] == "-"
