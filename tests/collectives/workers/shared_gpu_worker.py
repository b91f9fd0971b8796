"""Two ranks tell each other which GPU they would run NCCL on (hvd.init()'s check, fed the
places a GPU machine would give): with one GPU between them every rank reaches the same
verdict; with a GPU each there is none."""

from __future__ import annotations

import torch.distributed as dist
from checks import Checks, say

import collectives.torch as hvd
from collectives.runtime.groups import GpuPlace, job_facts, shared_gpu_error


def shared_gpus_in_job(control: object, place: GpuPlace) -> str | None:
    """hvd.init()'s verdict from every rank's place (gathered as hvd.init() gathers them)."""
    return shared_gpu_error(job_facts(control, place, {})[0])


def main() -> None:
    hvd.init()
    checks = Checks()
    rank = hvd.rank()
    control = dist.new_group(backend="gloo")

    # One visible GPU on the host: both ranks would use device 0, the same physical GPU.
    verdict = shared_gpus_in_job(control, GpuPlace(rank, "gpu-host", 0, "GPU-1111", 1))
    say(f"VERDICT {verdict}")
    checks.expect("shared GPU found", verdict is not None and "ranks 0, 1 would share" in verdict)

    # Each rank sees one GPU of its own (CUDA_VISIBLE_DEVICES per rank): device 0 for both,
    # two different GPUs.
    verdict = shared_gpus_in_job(control, GpuPlace(rank, "gpu-host", 0, f"GPU-{rank}", 1))
    checks.expect("a GPU each passes", verdict is None, verdict)
    hvd.shutdown()
    checks.finish(rank)


if __name__ == "__main__":
    main()
