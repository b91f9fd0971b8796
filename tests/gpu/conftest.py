"""The GPU tests: CUDA paths with several ranks on one GPU (CUDA tensors through Gloo,
``hvdrun --cuda-backend gloo``), and NCCL jobs that must end without an abort.

They need a CUDA GPU and skip without one (CI has none); ``make gpu-check`` runs them on
a GPU machine. ``HVDRUN_GPU_TESTS_ON_CPU=1`` runs the same workers on CPU tensors, to try
the tests themselves on a machine without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CPU = os.environ.get("HVDRUN_GPU_TESTS_ON_CPU") == "1"
#: The device the workers put their tensors on.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

needs_gpu = pytest.mark.skipif(
    DEVICE != "cuda" and not ON_CPU,
    reason="needs a CUDA GPU (make gpu-check runs these on a GPU machine)",
)
needs_nccl = pytest.mark.skipif(
    DEVICE != "cuda" or not torch.distributed.is_nccl_available(),
    reason="needs a CUDA GPU and NCCL",
)
