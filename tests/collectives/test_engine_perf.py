"""The engine's performance parts, without processes: the pool of large out-of-place
results, the response cache and the autotuner's search."""

from __future__ import annotations

import pytest
import torch

from collectives.torch.engine.execute import POOLED_BYTES, OutputPool
from tests.collectives.conftest import WORKERS, assert_all_ok, run_hvdrun


def test_output_pool_reuses_only_dropped_results() -> None:
    pool = OutputPool()
    numel = POOLED_BYTES // 4
    first = pool.empty((numel,), torch.float32)
    address = first.data_ptr()
    first.fill_(1.0)
    held = pool.empty((2, numel // 2), torch.float32)  # the first is still in use
    assert held.data_ptr() != address
    assert held.shape == (2, numel // 2)
    view = first[10:]
    del first
    # A view keeps the memory alive: not handed out again.
    other = pool.empty((numel,), torch.float32)
    other_address = other.data_ptr()
    assert other_address not in (address, held.data_ptr())
    assert float(view[0]) == 1.0
    del view, other
    # Both dropped: one of them comes back, already mapped.
    again = pool.empty((numel,), torch.int32)
    assert again.data_ptr() in (address, other_address)
    assert again.dtype == torch.int32
    # Small results are plain allocations, never pooled.
    small = pool.empty((4,), torch.float32)
    assert small.numel() == 4
    pool.clear()
    held.fill_(2.0)  # still the caller's after the pool let go
    assert float(held.sum()) == 2.0 * numel


@pytest.mark.parametrize("capacity", ["1024", "0", "1"])
def test_cache_on_off_and_evicting_give_the_same_results(capacity: str) -> None:
    code, output = run_hvdrun(
        2, WORKERS / "cache_worker.py", options=["--cache-capacity", capacity], timeout=120
    )
    checks = [f"step.{i}.{what}" for i in (0, 7, 100) for what in ("grad.0", "unnamed")]
    checks += ["large.2.sum", "large.2.average", "large.2.prescale", "mismatch.raises"]
    checks.append({"1024": "cache.used", "0": "cache.off", "1": "cache.evicts"}[capacity])
    assert_all_ok(code, output, 2, checks)
    assert f"[0]<stdout>:CAPACITY {capacity}\n" in output
