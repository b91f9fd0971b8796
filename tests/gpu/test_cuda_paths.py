"""Every CUDA path with several ranks on one GPU (through Gloo), an elastic reset on CUDA,
Keras 3 on torch on CUDA, TensorFlow on GPU tensors, and NCCL workers that end cleanly when
hvdrun is stopped. Skipped without a GPU (see conftest.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.collectives.conftest import REPO, assert_all_ok, clean_env, run_hvdrun
from tests.gpu.conftest import DEVICE, needs_gpu, needs_nccl
from tests.processes import run_stopped_for_a_while

WORKERS = Path(__file__).parent / "workers"
ELASTIC_WORKER = REPO / "tests" / "elastic" / "workers" / "elastic_steps.py"
SHARE = ["--cuda-backend", "gloo"]
TWO_HOSTS = "printf 'localhost\\n127.0.0.1\\n'"  # a discovery script

CHECKS = [
    "allreduce.SUM.torch.float32",
    "allreduce.PRODUCT.torch.uint8",
    "allreduce.AVERAGE.torch.bfloat16",
    "allreduce_async_.MAX.torch.int64",
    "allreduce.scaled",
    "allgather.torch.bool",
    "broadcast_.torch.float16",
    "alltoall.values",
    "reducescatter.sum",
    "reducescatter.average",
    "grouped_allreduce.1",
    "grouped_allgather.0",
    "grouped_reducescatter.0",
    "fusion.200",
    "mixed.cpu",
    "mixed.device",
    "optimizer.matches_one_process",
    "sync_batch_norm.output",
    "broadcast_optimizer_state.moments",
    "broadcast_object",
    "allgather_object",
]


@needs_gpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_every_cuda_path_with_ranks_sharing_the_gpu(ranks: int) -> None:
    code, output = run_hvdrun(
        ranks, WORKERS / "cuda_worker.py", options=SHARE, env={"TEST_DEVICE": DEVICE}, timeout=300
    )
    streams = ["stream.side_input", "stream.result_on_other_stream"] if DEVICE == "cuda" else []
    assert_all_ok(code, output, ranks, CHECKS + streams)


@needs_gpu
def test_an_elastic_reset_on_cuda() -> None:
    # 127.0.0.1's worker fails after step 5: the job resets and trains on at size 1, and
    # the weight shows every step applied exactly once.
    code, output = run_hvdrun(
        2,
        ELASTIC_WORKER,
        options=["--min-np", "1", "--host-discovery-script", TWO_HOSTS, *SHARE],
        env={
            "DEVICE": DEVICE,
            "STEPS": "20",
            "STEP_INTERVAL": "0.05",
            "FAIL_HOST": "127.0.0.1",
            "FAIL_AT_STEP": "5",
        },
        timeout=180,
    )
    assert code == 0, output
    assert "final rank=0 size=1 step=20 weight=-20" in output, output


@needs_gpu
@pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="Keras is not installed")
def test_keras_on_torch_on_cuda(tmp_path: Path) -> None:
    code, output = run_hvdrun(
        2,
        REPO / "examples" / "keras_digits.py",
        "--epochs",
        "3",
        options=SHARE,
        env={"KERAS_BACKEND": "torch"},
        timeout=300,
    )
    assert code == 0, output
    assert "[0]<stdout>:weights identical on every rank: True" in output, output


def _tensorflow_sees_a_gpu() -> bool:
    if importlib.util.find_spec("tensorflow") is None or DEVICE != "cuda":
        return False
    probe = "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip().splitlines()[-1:] != ["0"]


@needs_gpu
@pytest.mark.skipif(not _tensorflow_sees_a_gpu(), reason="needs a GPU build of TensorFlow")
def test_tensorflow_on_gpu_tensors() -> None:
    code, output = run_hvdrun(
        2,
        REPO / "examples" / "tensorflow2_digits.py",
        "--epochs",
        "2",
        options=SHARE,
        env={"TF_FORCE_GPU_ALLOW_GROWTH": "true"},  # two processes share the GPU's memory
        timeout=300,
    )
    assert code == 0, output
    assert "[0]<stdout>:weights identical on every rank: True" in output, output


HVDRUN = [sys.executable, "-m", "hvdrun"]
WORKER_COMMAND = [sys.executable, str(ELASTIC_WORKER)]


@needs_nccl
def test_nccl_workers_end_cleanly_while_hvdrun_is_stopped() -> None:
    # The job of issue 33: workers finished while hvdrun was stopped died by SIGABRT (NCCL's
    # monitor thread called the rendezvous store from C++ as the interpreter shut down).
    command = [*HVDRUN, "-np", "1", "--min-np", "1", "-H", "localhost:1", *WORKER_COMMAND]
    env = {**clean_env(), "DEVICE": "cuda", "STEPS": "40", "STEP_INTERVAL": "0.05"}
    # (the worker finishes its 40 steps while hvdrun is stopped)
    code, output = run_stopped_for_a_while(command, REPO, env, "committed step=5 ", 6)
    assert code == 0, output
    assert "terminate called" not in output and "SIGABRT" not in output, output
    assert "final rank=0 size=1 step=40 weight=-40" in output, output
