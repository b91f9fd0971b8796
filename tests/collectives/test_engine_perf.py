"""The engine's performance parts, without processes: the pool of large out-of-place
results, the response cache and the autotuner's search."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch

from collectives.engine.autotune import (
    Autotuner,
    Setting,
    expected_improvement,
    posterior_mean,
    suggest,
)
from collectives.engine.cache import Key, ResponseCache, key_of, ordinal
from collectives.engine.config import from_environment
from collectives.engine.execute import POOLED_BYTES, OutputPool
from collectives.engine.requests import Kind
from hvdrun.tuning import tuning_env
from tests.cli.conftest import assert_usage_error
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


def test_small_sums_gather_with_gloos_bits() -> None:
    code, output = run_hvdrun(2, WORKERS / "sums_worker.py", timeout=120)
    checks = ["exact.torch.float16.3", "path.torch.int64.65536", "path.torch.int64.65537"]
    checks += ["exact.torch.bfloat16.262144", "bits.gloo.torch.float32.100000", "nan"]
    checks += ["path.torch.float64.100000", "bits.gloo.torch.float64.100000", "transposed"]
    assert_all_ok(code, output, 2, checks)


@pytest.mark.parametrize("capacity", ["1024", "0", "1"])
def test_cache_on_off_and_evicting_give_the_same_results(capacity: str) -> None:
    code, output = run_hvdrun(
        2, WORKERS / "cache_worker.py", options=["--cache-capacity", capacity], timeout=120
    )
    checks = [f"step.{i}.{what}" for i in (0, 7, 100) for what in ("grad.0", "unnamed")]
    checks += ["large.2.sum", "large.2.average", "large.2.prescale", "mismatch.raises"]
    checks += ["riders.0", "riders.11", "threads", "lane.fallback"]
    checks += ["burst.sum.5", "burst.average.5", "burst.kept", "burst.fallback"]
    checks += ["parameter.0", "parameter.7", "parameter.no_grad", "lane.fallback.out"]
    checks += ["hot.average.9", "hot.refused", "hot.skipped.0", "hot.skipped.5", "hot.other.5"]
    checks += ["hot.unnamed.9", "burst.unnamed.5", "burst.unnamed.11", "burst.unnamed.extra.11"]
    checks += ["direct.ints.7", "direct.wide.7", "direct.parts.7", "direct.broadcast.5"]
    checks += ["direct.allgather.5", "direct.mixed.5", "direct.fallback"]
    checks += ["turns.loss.9", "turns.acc.9", "turns.ids.9", "turns.unnamed.9", "turns.count.9"]
    checks += ["turns.fallback", "hot.out.0", "hot.out.7", "hot.out.grad", "split.7"]
    checks += ["mismatch.held"]
    checks.append({"1024": "cache.used", "0": "cache.off", "1": "cache.evicts"}[capacity])
    if capacity == "1024":
        checks += ["burst.predicted", "hot.used", "burst.unnamed.predicted", "direct.used"]
        checks += ["turns.predicted", "hot.out.used", "split.held"]
    assert_all_ok(code, output, 2, checks)
    assert f"[0]<stdout>:CAPACITY {capacity}\n" in output


def test_autotune_logs_samples_and_keeps_ranks_in_step(tmp_path: Path) -> None:
    log = tmp_path / "autotune.csv"
    options = ["--fusion-threshold-mb", "1", "--cycle-time-ms", "20", "--autotune"]
    options += ["--autotune-log-file", str(log), "--autotune-warmup-samples", "1"]
    options += ["--autotune-steps-per-sample", "2", "--autotune-bayes-opt-max-samples", "4"]
    code, output = run_hvdrun(2, WORKERS / "cache_worker.py", options=options, timeout=120)
    assert_all_ok(code, output, 2, ["step.7.grad.0", "large.2.average", "mismatch.raises"])
    finals = re.findall(r"\[(\d)\]<stdout>:FINAL (.*)", output)
    assert len(finals) == 2 and finals[0][1] == finals[1][1], finals
    with open(log) as file:
        rows = list(csv.DictReader(file))
    assert [row["phase"] for row in rows] == [
        "warmup",
        *["baseline", "sample"] * 4,
        "final",
    ], rows
    assert rows[0]["score"] == "" and float(rows[0]["mb_per_s"]) > 0
    samples = [row for row in rows if row["phase"] == "sample"]
    assert all(float(row["score"]) > 0 for row in samples)
    # The baseline is the given setting; the search keeps one it sampled.
    baselines = [row for row in rows if row["phase"] == "baseline"]
    assert {(row["fusion_threshold_mb"], row["cycle_time_ms"]) for row in baselines} == {
        ("1", "20")
    }
    final = rows[-1]
    keys = ("fusion_threshold_mb", "cycle_time_ms", "cache_enabled")
    assert [final[k] for k in keys] in [[row[k] for k in keys] for row in rows[1:-1]]
    threshold, cycle_ms, cache = finals[0][1].split()
    assert int(cache) == int(final["cache_enabled"])
    assert abs(int(threshold) / 2**20 - float(final["fusion_threshold_mb"])) < 1e-3
    assert float(cycle_ms) == float(final["cycle_time_ms"])


def test_setting_round_trips_through_the_unit_cube() -> None:
    setting = Setting(8 * 1024 * 1024, 2.0, True)
    back = Setting.at(setting.point())
    assert abs(back.fusion_threshold - setting.fusion_threshold) < 1024
    assert back.cycle_time_ms == 2.0 and back.cache
    assert Setting.at([0.0, 0.0, 0.2]) == Setting(256 * 1024, 0.5, False)


def test_expected_improvement_favours_promising_unexplored_points() -> None:
    xs = torch.tensor([[0.1, 0.1, 0.0], [0.5, 0.5, 0.0], [0.9, 0.9, 0.0]], dtype=torch.float64)
    ys = torch.tensor([1.0, 5.0, 1.0], dtype=torch.float64)
    candidates = torch.tensor(
        [[0.55, 0.5, 0.0], [0.1, 0.1, 0.0], [0.9, 0.9, 0.0]], dtype=torch.float64
    )
    mean = posterior_mean(xs, ys, xs, noise=0.01)
    assert int(mean.argmax()) == 1 and abs(float(mean[1]) - 5.0) < 0.1
    ei = expected_improvement(xs, ys, candidates, noise=0.01)
    assert int(ei.argmax()) == 0
    assert bool((ei >= 0).all())
    point = suggest(xs.tolist(), ys.tolist(), 0.01, torch.Generator().manual_seed(0))
    assert len(point) == 3 and point[2] in (0.0, 1.0)
    assert all(0.0 <= v <= 1.0 for v in point)


def test_autotuner_skips_warmup_and_settles_on_the_best(tmp_path: Path) -> None:
    log = tmp_path / "tune.csv"
    tuner = Autotuner(
        0,
        Setting(1024 * 1024, 20.0, True),
        warmup_samples=1,
        steps_per_sample=2,
        max_samples=3,
        noise=0.5,
        log_file=str(log),
    )
    chosen = []
    for sample in range(20):
        assert not tuner.step(100)
        assert tuner.step(100 * (sample + 1))
        setting = tuner.decide()
        chosen.append(setting)
        tuner.apply(setting, tuner.finishing)
        if tuner.done:
            break
    assert tuner.done and not tuner.step(1)
    with open(log) as file:
        rows = list(csv.DictReader(file))
    phases = [row["phase"] for row in rows]
    assert phases == ["warmup", *["baseline", "sample"] * 3, "final"], phases
    # Candidates alternate with the starting setting, which the warm-up keeps too.
    start = Setting(1024 * 1024, 20.0, True)
    assert chosen[0] == start and chosen[2] == start and chosen[1] != start


def test_the_autotune_log_makes_its_directory_or_tuning_goes_on_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = Setting(1024 * 1024, 20.0, True)
    knobs = {"warmup_samples": 0, "steps_per_sample": 2, "max_samples": 3, "noise": 0.5}
    nested = tmp_path / "new" / "dir" / "tune.csv"
    Autotuner(0, start, **knobs, log_file=str(nested)).close()
    assert nested.read_text().startswith("sample,phase,")
    blocker = tmp_path / "file"
    blocker.write_text("")
    tuner = Autotuner(0, start, **knobs, log_file=str(blocker / "tune.csv"))
    assert not tuner.step(100) and tuner.step(100)
    tuner.apply(tuner.decide(), tuner.finishing)  # tunes on, with nothing to write
    tuner.close()
    assert capsys.readouterr().err == (
        f"hvdrun: rank 0 writes no autotune log: File exists: {blocker}\n"
    )
    # A log it can open but not write (a full disk): the same.
    tuner = Autotuner(0, start, **knobs, log_file="/dev/full")
    assert not tuner.step(100) and tuner.step(100)
    tuner.apply(tuner.decide(), tuner.finishing)
    tuner.close()
    assert capsys.readouterr().err == (
        "hvdrun: rank 0 writes no autotune log: No space left on device: /dev/full\n"
    )


def test_response_cache_evicts_least_recently_used_into_the_same_index() -> None:
    cache = ResponseCache(2)
    a, b, c = [key_of(Kind.ALLREDUCE, 0, f"allreduce.{n}", "sig", "")[0] for n in "abc"]
    assert (cache.use(a), cache.use(b)) == (0, 1)
    assert cache.use(a) == 0  # a is now the most recently used
    assert cache.use(c) == 1  # b goes, c takes its index
    assert cache.lookup(b) is None and cache.lookup(c) == 1 and cache.evictions == 1
    assert len(cache) == 2


def test_a_ragged_op_has_one_entry_whose_per_rank_part_must_match() -> None:
    # A variable-length allgather that ran with the same first dimension on every rank at
    # two steps (3 rows, then 4): one entry, holding the latest part. A rank that now has
    # 3 rows while another has 4 must find nothing (the cycle negotiates in full at once):
    # with an entry per part each found one of its own, at different indices, and the op
    # waited a second as if only some ranks had submitted it.
    cache = ResponseCache(8)
    three, _ = key_of(Kind.ALLGATHER, 0, "allgather.ids", "sig", "3")
    four, _ = key_of(Kind.ALLGATHER, 0, "allgather.ids", "sig", "4")
    other, _ = key_of(Kind.ALLGATHER, 0, "allgather.other", "sig", "3")
    assert cache.use(three) == 0 and cache.use(other) == 1
    assert cache.use(four) == 0 and len(cache) == 2
    assert cache.lookup(four) == 0 and cache.lookup(three) is None
    assert cache.evictions == 1  # (what was planned from the old key is stale)
    assert cache.use(three) == 0 and cache.lookup(four) is None


def test_unnamed_ops_share_a_key_and_carry_their_counter() -> None:
    key, counter = key_of(Kind.ALLREDUCE, 0, "allreduce.noname.41", "sig", "")
    other, other_counter = key_of(Kind.ALLREDUCE, 0, "allreduce.noname.42", "sig", "")
    assert key == other and (counter, other_counter) == (42, 43)
    named, zero = key_of(Kind.ALLREDUCE, 0, "allreduce.noname.x", "sig", "")
    assert named != key and zero == 0
    # Within a round, the k-th unnamed op alike has an entry of its own; named ops keep theirs.
    seen: dict[Key, int] = {}
    first, second = ordinal(key, counter, seen), ordinal(other, other_counter, seen)
    assert first == key and second not in (key, named)
    assert ordinal(named, 0, seen) == named and ordinal(named, 0, seen) == named
    third, _ = key_of(Kind.ALLREDUCE, 0, "allreduce.noname.43", "sig", "")
    assert ordinal(third, 44, seen) not in (first, second)
    assert ordinal(third, 44, {}) == first  # (the next round starts over)
    # No name a user may give (hvd refuses control characters) makes a key of unnamed ops.
    for name in ("noname.*", "noname.*1", "noname."):
        imitation, _ = key_of(Kind.ALLREDUCE, 0, f"allreduce.{name}", "sig", "")
        assert imitation not in (first, second), name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cache-capacity", "-1", "true"], "-1 is not in the range x>=0"),
        (["--autotune-steps-per-sample", "0", "true"], "0 is not in the range x>=1"),
        (["--autotune-gaussian-process-noise", "2", "true"], "2.0 is not in the range 0<=x<=1"),
    ],
)
def test_bad_tuning_flags_are_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_usage_error(argv, message, capsys)


def test_tuning_flags_become_worker_variables_horovod_spelling_read_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flags = {
        "cache_capacity": 0,
        "autotune": True,
        "autotune_log_file": "tune.csv",
        "autotune_warmup_samples": 2,
        "autotune_steps_per_sample": 5,
        "autotune_bayes_opt_max_samples": 7,
        "autotune_gaussian_process_noise": 0.5,
    }
    env = {k: v for name, value in flags.items() for k, v in tuning_env(name, value).items()}
    assert env["HVDRUN_CACHE_CAPACITY"] == "0"
    assert env["HVDRUN_AUTOTUNE"] == "1"
    assert Path(env["HVDRUN_AUTOTUNE_LOG"]).is_absolute()
    assert env["HVDRUN_AUTOTUNE_STEPS_PER_SAMPLE"] == "5"
    for name, value in env.items():
        monkeypatch.setenv(name.replace("HVDRUN_", "HOROVOD_"), value)
    config = from_environment()
    assert (config.cache_capacity, config.autotune, config.autotune_warmup_samples) == (0, True, 2)
    assert config.autotune_bayes_opt_max_samples == 7
    assert config.autotune_gaussian_process_noise == 0.5
    assert config.autotune_log == env["HVDRUN_AUTOTUNE_LOG"]


@pytest.mark.parametrize(
    ("setting", "value", "words"),
    [
        ("HOROVOD_FUSION_THRESHOLD", "0", "HVDRUN_FUSION_THRESHOLD (or HOROVOD_FUSION_THRESHOLD): "
         "rank 0: 134217728; rank 1: 0"),
        ("HVDRUN_CACHE_CAPACITY", "0", "HVDRUN_CACHE_CAPACITY (or HOROVOD_CACHE_CAPACITY): "
         "rank 0: 1024; rank 1: 0"),
    ],
)  # fmt: skip
def test_ranks_with_different_engine_settings_are_refused_at_init(
    setting: str, value: str, words: str
) -> None:
    code, output = run_hvdrun(
        2, WORKERS / "settings_worker.py", env={"SETTING": setting, "VALUE": value}
    )
    assert code == 3, output
    refusals = {
        line.split("<", 1)[0]: line.split(":", 1)[1]
        for line in output.splitlines()
        if ">:REFUSED " in line
    }
    assert sorted(refusals) == ["[0]", "[1]"], output  # both ranks refused,
    assert len(set(refusals.values())) == 1, output  # with the same words
    assert words in refusals["[0]"], output


def test_a_threshold_set_to_its_default_on_one_rank_counts_only_where_cuda_runs() -> None:
    # Only CUDA reductions differ then (4 MiB unless a threshold is set): ranks without a GPU
    # run together as before; ranks with one are refused.
    code, output = run_hvdrun(
        2,
        WORKERS / "settings_worker.py",
        env={"SETTING": "HVDRUN_FUSION_THRESHOLD", "VALUE": str(128 << 20)},
    )
    if torch.cuda.is_available():
        assert code == 3 and "fusion threshold of CUDA reductions" in output, output
    else:
        assert code == 0, output
        assert output.count(">:INIT OK") == 2, output
