"""Start-up of a 2-worker job on Ray: RayExecutor against Ray Train's TorchTrainer.

One local Ray instance (``ray.init(num_cpus=2)``, not timed) serves every round; the two
ways of starting the same job alternate, round after round:

* ``RayExecutor``: from ``RayExecutor(num_workers=2).start()`` until the first
  ``run(fn)`` returns, where ``fn`` imports torch and ``collectives.torch`` and calls
  ``hvd.init()`` (the actors join the executor's rendezvous and build their process groups);
  also the same plus ``shutdown()``, since ``fit()`` below includes tearing its workers down;
* ``TorchTrainer``: ``TorchTrainer(fn, ScalingConfig(num_workers=2)).fit()``, where Ray
  Train creates the workers and their process group and ``fn`` returns at once
  (``--trainer-hvd``: ``fn`` calls ``hvd.init()`` too, which adopts Ray's process group).

Prints the median and range of each in seconds and TorchTrainer's median over each of the
executor's. Without Ray (``pip install 'hvdrun[ray]'``) it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from collectives.ray import RayExecutor
except ImportError as missing:  # make bench runs every script: say why and pass
    print(f"ray_startup: skipped: {missing} (pip install 'hvdrun[ray]')")
    sys.exit(0)


def joined() -> int:
    import collectives.torch as hvd

    hvd.init()
    return hvd.rank()


def trainer_fn(config: dict[str, Any]) -> None:
    if config["hvd"]:
        import collectives.torch as hvd

        hvd.init()
        hvd.shutdown()


def executor_round() -> tuple[float, float]:
    """(start -> first run() returned, the same plus shutdown) in seconds."""
    started = time.perf_counter()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2)
    try:
        executor.start()
        ranks = executor.run(joined)
        first = time.perf_counter() - started
    finally:
        executor.shutdown()
    if ranks != [0, 1]:
        raise RuntimeError(f"RayExecutor: ranks {ranks}")
    return first, time.perf_counter() - started


def trainer_round(storage: str, index: int, with_hvd: bool) -> float:
    started = time.perf_counter()
    TorchTrainer(
        trainer_fn,
        train_loop_config={"hvd": with_hvd},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=f"startup{index}", storage_path=storage),
    ).fit()
    return time.perf_counter() - started


def summary(name: str, values: list[float]) -> str:
    return f"{name:<44}{statistics.median(values):>9.2f}{min(values):>9.2f} .. {max(values):<7.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trainer-hvd", action="store_true", help="hvd.init() in TorchTrainer")
    args = parser.parse_args()
    logging.getLogger("ray").setLevel(logging.WARNING)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp()
    executor_round()  # warm: imports, the first worker processes
    trainer_round(storage, 0, args.trainer_hvd)
    first: list[float] = []
    whole: list[float] = []
    trained: list[float] = []
    for index in range(1, args.rounds + 1):
        to_first, to_end = executor_round()
        first.append(to_first)
        whole.append(to_end)
        trained.append(trainer_round(storage, index, args.trainer_hvd))
    ray.shutdown()
    fn = "hvd.init()" if args.trainer_hvd else "returns at once"
    print(
        f"ray_startup: 2 workers, ray {ray.__version__}, {os.cpu_count()} CPUs, "
        f"{args.rounds} alternating rounds after one warm-up each (seconds)"
    )
    print(f"{'':<44}{'median':>9}{'range':>11}")
    print(summary("RayExecutor: start() -> first run() returned", first))
    print(summary("RayExecutor: the same + shutdown()", whole))
    print(summary(f"TorchTrainer.fit() (fn {fn})", trained))
    median = statistics.median(trained)
    print(
        f"TorchTrainer / RayExecutor: {median / statistics.median(first):.1f}x "
        f"(to the first result), {median / statistics.median(whole):.1f}x (incl. shutdown)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
