"""TensorFlow and Keras on the engine: the cost of the TensorFlow path, and Keras fit speed.

1. **Allreduce through collectives.tensorflow against collectives.torch** (issue 27's
   target: <= 1.10x): the same float32 tensors of 4 B, 4 MB and 64 MB, allreduced as
   ``tf.Tensor`` and as ``torch.Tensor`` in one ``hvdrun -np 2`` job, variants round-robin
   (bench/tensorflow_scripts/tf_allreduce.py). The difference is the DLPack hand-over.
2. **Keras fit, steps per second at 2 processes** (target: collectives.keras >= 1.0x
   TensorFlow's ``MultiWorkerMirroredStrategy``): the digits model, 32 samples per process
   and step, epochs after the first timed (bench/tensorflow_scripts/keras_fit.py). Variants:
   MultiWorkerMirroredStrategy (2 processes with ``TF_CONFIG``, its collective all-reduce)
   on tf_keras (Keras 2: Keras 3.15's ``fit`` fails under that strategy), and
   ``collectives.keras`` under ``hvdrun -np 2`` on tf_keras (the like-for-like comparison),
   on Keras 3's TensorFlow backend and on its torch backend. Each round runs every variant
   once, in turn; the table shows medians and ranges over the rounds.

Without TensorFlow or Keras installed it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "tensorflow_scripts"
REPO = HERE.parent


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TF_USE_LEGACY_KERAS", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra)
    return env


def _hvdrun(*args: str, env: dict[str, str]) -> str:
    hvdrun = shutil.which("hvdrun", path=str(Path(sys.executable).parent)) or "hvdrun"
    result = subprocess.run(
        [hvdrun, "-np", "2", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the job failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def _result(output: str) -> str:
    for line in output.splitlines():
        _, _, text = line.partition("RESULT ")
        if text:
            return text
    raise RuntimeError(f"no RESULT line in:\n{output[-3000:]}")


def allreduce_table(rounds: int) -> None:
    output = _hvdrun(str(SCRIPTS / "tf_allreduce.py"), "--rounds", str(rounds), env=_env())
    samples: dict[str, list[float]] = json.loads(_result(output))
    print(f"allreduce (Sum, float32), 2 ranks, Gloo, CPU; medians of {rounds} rounds")
    print(f"{'size':<8}{'torch ms':>10}{'tf ms':>10}{'tf/torch':>10}{'range of round ratios':>26}")
    for size in ("4B", "4MB", "64MB"):
        torch_ms, tf_ms = samples[f"{size}.torch"], samples[f"{size}.tf"]
        ratios = sorted(t / b for t, b in zip(tf_ms, torch_ms, strict=True))
        ratio = statistics.median(tf_ms) / statistics.median(torch_ms)
        print(
            f"{size:<8}{statistics.median(torch_ms):>10.3f}{statistics.median(tf_ms):>10.3f}"
            f"{ratio:>9.3f}x{f'{ratios[0]:.2f}-{ratios[-1]:.2f}x':>26}"
        )
    print("target: tf/torch <= 1.10x at every size")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


LEGACY = {"TF_USE_LEGACY_KERAS": "1"}


def _mwms(epochs: int) -> float:
    ports = _free_ports(2)
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    argv = [sys.executable, str(SCRIPTS / "keras_fit.py"), "--mode", "mwms"]
    argv += ["--epochs", str(epochs)]
    procs = []
    for index in range(2):
        config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        procs.append(
            subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(TF_CONFIG=config, **LEGACY),
            )
        )
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"MultiWorkerMirroredStrategy failed:\n{out}\n{err[-3000:]}")
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return float(_result(outputs[0]).split()[0])


def _hvd(env: dict[str, str], epochs: int) -> float:
    script = [str(SCRIPTS / "keras_fit.py"), "--mode", "hvd", "--epochs", str(epochs)]
    return float(_result(_hvdrun(*script, env=_env(**env))).split()[0])


def fit_table(rounds: int, epochs: int) -> None:
    variants = {
        "MWMS, tf_keras": lambda: _mwms(epochs),
        "collectives.keras, tf_keras": lambda: _hvd(LEGACY, epochs),
        "collectives.keras, Keras 3 on TF": lambda: _hvd({"KERAS_BACKEND": "tensorflow"}, epochs),
        "collectives.keras, Keras 3 on torch": lambda: _hvd({"KERAS_BACKEND": "torch"}, epochs),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for round_ in range(rounds):
        for name in order if round_ % 2 == 0 else list(reversed(order)):
            samples[name].append(variants[name]())
    base = statistics.median(samples[order[0]])
    print(
        f"\nKeras fit, digits MLP, 2 processes x 32 samples per step, CPU; "
        f"medians of {rounds} rounds, epochs 2-{epochs} timed"
    )
    print(f"{'variant':<38}{'steps/s':>10}{'range':>16}{'vs MWMS':>10}")
    for name, values in samples.items():
        median = statistics.median(values)
        spread = f"{min(values):.1f}-{max(values):.1f}"
        print(f"{name:<38}{median:>10.1f}{spread:>16}{median / base:>9.2f}x")
    print("target: collectives.keras on tf_keras >= 1.0x MultiWorkerMirroredStrategy on tf_keras")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=11, help="allreduce rounds")
    parser.add_argument("--fit-rounds", type=int, default=3, help="rounds of the fit table")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per fit (first untimed)")
    parser.add_argument("--skip-fit", action="store_true", help="only the allreduce table")
    args = parser.parse_args()
    missing = [m for m in ("tensorflow", "keras") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"tensorflow_keras: skipped ({', '.join(missing)} not installed)")
        return 0
    allreduce_table(args.rounds)
    if not args.skip_fit:
        fit_table(args.fit_rounds, args.epochs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
