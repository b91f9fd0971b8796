"""``hvdrun --check-hosts``' view of one host, gathered by that host's agent.

The agent itself never imports torch, so the torch facts (version, CUDA, GPUs, NCCL, Gloo)
come from ``python -m launcher.agent.probe``, a child process that does. The agent adds its
versions, the interface that faces hvdrun and whether a TCP connection back to hvdrun works,
which is what a job's workers need to reach the rendezvous server. With several hosts it
also listens on the address its ranks would give Gloo (:func:`gloo_listener`) and, once
every host has said where, tries the others' (``reachability.reach_peers``): what the
workers of a job need to reach each other.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from launcher.transport.hostinfo import installed_versions
from launcher.transport.reachability import CONNECT_BACK_TIMEOUT, Listener, connect_problem
from rendezvous.addresses import gloo_interface, interface_facing, join_addr

TORCH_PROBE_TIMEOUT = 120.0


def describe_torch() -> dict[str, Any]:
    """Imports torch (seconds) and reports what it can run on this host."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # torch missing or broken: report it, do not crash
        return {"torch_error": f"cannot import torch: {exc}"}
    distributed = dist.is_available()
    info: dict[str, Any] = {
        "torch_imported": torch.__version__,
        "cuda": torch.version.cuda,
        "gloo": bool(distributed and dist.is_gloo_available()),
        "nccl": None,
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if distributed and dist.is_nccl_available():
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else "yes"
        except Exception:  # built with NCCL, but the library does not load here
            info["nccl"] = "unusable"
    return info


def _torch_facts() -> dict[str, Any]:
    try:
        result = subprocess.run(
            [sys.executable, "-m", "launcher.agent.probe"],
            capture_output=True,
            timeout=TORCH_PROBE_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"torch_error": f"importing torch took over {TORCH_PROBE_TIMEOUT:.0f} s"}
    try:
        facts: dict[str, Any] = json.loads(result.stdout.decode().strip().splitlines()[-1])
        return facts
    except (ValueError, IndexError):
        tail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"torch_error": f"torch probe failed: {tail[0]}"}


def probe_host(connect_back: str | None, peers: Sequence[str] = ()) -> dict[str, Any]:
    facts: dict[str, Any] = {"hostname": socket.gethostname(), **installed_versions()}
    facts.update(_torch_facts())
    if connect_back:
        facts.update(network_facts(connect_back, peers))
        facts["connect_back_error"] = connect_problem(connect_back, CONNECT_BACK_TIMEOUT)
    return facts


def gloo_listener(facts: dict[str, Any]) -> Listener | None:
    """A mesh probe's listener on the address this host's ranks would give Gloo (the
    facts' ``gloo_address``, else ``address``), which the facts then name (``gloo_listen``);
    None where there is no such address or it cannot be listened on."""
    address = facts.get("gloo_address") or facts.get("address")
    if not address:
        return None
    try:
        listener = Listener(address)
    except OSError as exc:
        facts["gloo_listen_error"] = f"cannot listen on {address}: {exc.strerror or exc}"
        return None
    facts["gloo_listen"] = join_addr(address, listener.port)
    return listener


def network_facts(connect_back: str, peers: Sequence[str]) -> dict[str, Any]:
    """The interface (and address) facing hvdrun, and the one a job's Gloo and NCCL would
    get here where another faces most of the other hosts (``peers``), as agents choose."""
    facing = interface_facing(connect_back)
    facts: dict[str, Any] = {"ifname": facing[0], "address": facing[1]}
    gloo = gloo_interface(facing, peers)
    if gloo[0] != facing[0]:
        facts["gloo_ifname"], facts["gloo_address"] = gloo
    return facts


if __name__ == "__main__":
    print(json.dumps(describe_torch()), flush=True)
