"""Autotune: the engine's tuning, searched online while the job runs (``--autotune``).

What is tuned: the fusion threshold, the cycle time and whether the response cache is on --
everything the engine exposes that changes its speed and not its results. A *sample* is
at least ``steps_per_sample`` engine cycles that ran ops, and about half a second (rank 0
sets each sample's length in cycles from the pace of the one before), so that it spans whole
training steps; its rate is the bytes those ops moved per second on rank 0 (for a training
loop, proportional to its steps per second). The first ``warmup_samples`` samples are not
scored (buffers grow, caches fill, the allocator settles). After them, samples alternate
between the starting setting (the baseline) and a candidate, and a candidate's score is its
rate relative to the baseline sample just before it: on a shared machine the load drifts by
more than settings differ, and a ratio of neighbours cancels the drift.

The search is Bayesian optimisation, as in Horovod: a Gaussian process (RBF kernel, the
configured noise on its diagonal) over the normalised parameters (log2 of the threshold and
of the cycle time, the cache as 0/1) models the score; the next sample takes the candidate
with the largest expected improvement over the best score so far. After
``bayes_opt_max_samples`` scored candidates, the sampled setting with the best score by the
process's mean (which smooths the noise of a single lucky sample) stays for the rest of the job.

Only rank 0 scores and decides. Every rank reaches a sample's end at the same cycle (it
counts cycles that ran ops, which every rank sees alike), and there all ranks take rank 0's
decision in one small broadcast on the negotiation's group, so every rank always runs with
the same values. Rank 0 writes one CSV row per sample (``--autotune-log-file``).
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Autotuner", "Setting", "expected_improvement", "posterior_mean", "suggest"]

#: Search ranges, as log2: fusion threshold 256 KiB .. 128 MiB, cycle time 0.5 .. 32 ms.
THRESHOLD_LOG2_MB = (-2.0, 7.0)
CYCLE_LOG2_MS = (-1.0, 5.0)
LENGTH_SCALE = 0.3
CANDIDATES = 2000
#: A sample also lasts about this long (in busy cycles at the last sample's pace), so that it
#: spans whole training steps: a window over part of a step (its backward pass, where the
#: bytes flow) would score settings that split a step into many cycles too well.
SAMPLE_SECONDS = 0.5
MAX_SAMPLE_CYCLES = 2000


@dataclass(frozen=True)
class Setting:
    fusion_threshold: int  # bytes
    cycle_time_ms: float
    cache: bool

    def point(self) -> list[float]:
        """The setting in the unit cube the Gaussian process works in."""
        mb = max(self.fusion_threshold, 1) / (1024 * 1024)
        return [
            _unit(math.log2(mb), THRESHOLD_LOG2_MB),
            _unit(math.log2(max(self.cycle_time_ms, 1e-3)), CYCLE_LOG2_MS),
            1.0 if self.cache else 0.0,
        ]

    @classmethod
    def at(cls, point: list[float]) -> Setting:
        mb = 2.0 ** _scaled(point[0], THRESHOLD_LOG2_MB)
        ms = 2.0 ** _scaled(point[1], CYCLE_LOG2_MS)
        return cls(int(mb * 1024 * 1024), round(ms, 3), point[2] >= 0.5)


def _unit(value: float, bounds: tuple[float, float]) -> float:
    low, high = bounds
    return min(1.0, max(0.0, (value - low) / (high - low)))


def _scaled(unit: float, bounds: tuple[float, float]) -> float:
    low, high = bounds
    return low + unit * (high - low)


def _kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.exp(-torch.cdist(a, b).square() / (2 * LENGTH_SCALE**2))


def posterior_mean(
    xs: torch.Tensor, ys: torch.Tensor, points: torch.Tensor, noise: float
) -> torch.Tensor:
    """The Gaussian process's mean score at ``points`` (in the units of ``ys``)."""
    mean, std = ys.mean(), ys.std() if len(ys) > 1 else torch.tensor(1.0, dtype=ys.dtype)
    scale = std if std > 0 else torch.tensor(1.0, dtype=ys.dtype)
    k = _kernel(xs, xs) + (noise + 1e-9) * torch.eye(len(xs), dtype=xs.dtype)
    alpha = torch.linalg.solve(k, ((ys - mean) / scale).unsqueeze(1))
    return mean + scale * (_kernel(points, xs) @ alpha).squeeze(1)


def expected_improvement(
    xs: torch.Tensor, ys: torch.Tensor, candidates: torch.Tensor, noise: float, xi: float = 0.01
) -> torch.Tensor:
    """The expected improvement of each candidate over the best of ``ys`` (maximising),
    under a Gaussian process fit to the observations (scores normalised)."""
    mean, std = ys.mean(), ys.std() if len(ys) > 1 else torch.tensor(1.0, dtype=ys.dtype)
    y = (ys - mean) / (std if std > 0 else 1.0)
    k = _kernel(xs, xs) + (noise + 1e-9) * torch.eye(len(xs), dtype=xs.dtype)
    chol = torch.linalg.cholesky(k)
    alpha = torch.cholesky_solve(y.unsqueeze(1), chol)
    k_star = _kernel(candidates, xs)
    mu = (k_star @ alpha).squeeze(1)
    v = torch.cholesky_solve(k_star.T, chol)
    var = (1.0 - (k_star * v.T).sum(1)).clamp_min(1e-12)
    sigma = var.sqrt()
    improvement = mu - y.max() - xi
    z = improvement / sigma
    normal = torch.distributions.Normal(0.0, 1.0)
    return improvement * torch.special.ndtr(z) + sigma * normal.log_prob(z).exp()


def suggest(
    points: list[list[float]], scores: list[float], noise: float, generator: torch.Generator
) -> list[float]:
    """The next point to sample: random candidates (the cache dimension 0 or 1), the one
    with the largest expected improvement."""
    candidates = torch.rand(CANDIDATES, 3, generator=generator, dtype=torch.float64)
    candidates[:, 2] = candidates[:, 2].round()
    xs = torch.tensor(points, dtype=torch.float64)
    ys = torch.tensor(scores, dtype=torch.float64)
    ei = expected_improvement(xs, ys, candidates, noise)
    return [float(v) for v in candidates[int(ei.argmax())]]


class Autotuner:
    """Counts samples on every rank; scores, decides and logs on rank 0."""

    def __init__(
        self,
        rank: int,
        start: Setting,
        *,
        warmup_samples: int,
        steps_per_sample: int,
        max_samples: int,
        noise: float,
        log_file: str | None,
    ) -> None:
        self.rank = rank
        self.current = start
        self.warmup_samples = warmup_samples
        self.steps_per_sample = steps_per_sample
        self.max_samples = max_samples
        self.noise = noise
        self.done = False
        self._steps = 0
        self._bytes = 0
        self._started = time.monotonic()
        self.sample_cycles = steps_per_sample  # the current sample's length, alike everywhere
        self._samples = 0
        self._points: list[list[float]] = []
        self._scores: list[float] = []
        self._settings: list[Setting] = []
        self._generator = torch.Generator().manual_seed(15)
        self._start = start
        # The baseline counts as a sampled point of relative score 1; the first candidate
        # is drawn at random (expected improvement needs two points to mean anything).
        self._points.append(start.point())
        self._scores.append(1.0)
        self._settings.append(start)
        first = torch.rand(3, generator=self._generator, dtype=torch.float64)
        first[2] = first[2].round()
        self._candidate = Setting.at([float(v) for v in first])
        self._baseline_rate: float | None = None
        self._log: Any = None
        self._writer: Any = None
        if rank == 0 and log_file:
            self._open_log(log_file)

    def _open_log(self, log_file: str) -> None:
        """Opens the log, creating its directory; a rank that cannot says so and tunes on
        without it (as with the timeline: the path is a setting of the whole job)."""
        try:
            os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
            self._log = open(log_file, "w", newline="")  # noqa: SIM115 -- lives with the job
        except OSError as error:
            with contextlib.suppress(Exception):  # (stderr may be closed)
                sys.stderr.write(
                    f"hvdrun: rank 0 writes no autotune log: {error.strerror or error}: "
                    f"{error.filename or log_file}\n"
                )
            return
        self._writer = csv.writer(self._log)
        header = ["sample", "phase", "fusion_threshold_mb", "cycle_time_ms", "cache_enabled"]
        self._write([*header, "mb_per_s", "score"], "writes no autotune log")

    def step(self, nbytes: int) -> bool:
        """One cycle that ran ops (``nbytes`` of data on this rank); True at a sample's end,
        which every rank reaches at the same cycle."""
        if self.done:
            return False
        self._steps += 1
        self._bytes += nbytes
        return self._steps >= self.sample_cycles

    def next_sample_cycles(self) -> int:
        """Rank 0, at a sample's end: the next sample's length in busy cycles."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        paced = math.ceil(self._steps / elapsed * SAMPLE_SECONDS)
        return min(MAX_SAMPLE_CYCLES, max(self.steps_per_sample, paced))

    def decide(self) -> Setting:
        """Rank 0, at a sample's end: scores it and returns the next setting.

        After the warm-up, samples alternate between the starting setting (the *baseline*)
        and a candidate; a candidate's score is its rate relative to the baseline sample
        just before it, so that the load of a shared machine, which drifts by more than
        the settings differ, cancels out. The baseline itself counts as a point of score 1.
        """
        now = time.monotonic()
        elapsed = max(now - self._started, 1e-9)
        rate = self._bytes / elapsed / 1e6
        self._samples += 1
        sample = self.current
        if self._samples <= self.warmup_samples:
            self._row("warmup", sample, rate, None)
            return sample
        if self._baseline_rate is None:  # a baseline sample ended: try the candidate
            self._baseline_rate = rate
            self._row("baseline", sample, rate, None)
            return self._candidate
        score = rate / max(self._baseline_rate, 1e-12)
        self._baseline_rate = None
        self._points.append(sample.point())
        self._scores.append(score)
        self._settings.append(sample)
        self._row("sample", sample, rate, score)
        if len(self._scores) > self.max_samples:  # (the first point is the baseline)
            best = self._settings[self._best()]
            self._row("final", best, None, None)
            return best
        self._candidate = Setting.at(
            suggest(self._points, self._scores, self.noise, self._generator)
        )
        return self._start

    def apply(self, setting: Setting, final: bool, cycles: int | None = None) -> None:
        """Every rank, after the broadcast: the next sample starts with ``setting`` and
        lasts ``cycles`` busy cycles."""
        self.current = setting
        if cycles is not None:
            self.sample_cycles = cycles
        self._steps = 0
        self._bytes = 0
        self._started = time.monotonic()
        if final:
            self.done = True
            self.close()

    def _best(self) -> int:
        """The sample whose setting the Gaussian process rates best: its mean at the
        sampled points, which smooths the noise a single lucky sample would carry."""
        xs = torch.tensor(self._points, dtype=torch.float64)
        ys = torch.tensor(self._scores, dtype=torch.float64)
        mean = posterior_mean(xs, ys, xs, self.noise)
        return int(mean.argmax())

    @property
    def finishing(self) -> bool:
        """Rank 0: whether the sample that just ended was the last one."""
        return len(self._scores) > self.max_samples

    def _row(
        self, phase: str, setting: Setting, rate: float | None, relative: float | None
    ) -> None:
        if self._writer is None:
            return
        row = [
            self._samples,
            phase,
            f"{setting.fusion_threshold / (1024 * 1024):g}",
            f"{setting.cycle_time_ms:g}",
            int(setting.cache),
            "" if rate is None else f"{rate:.3f}",
            "" if relative is None else f"{relative:.4f}",
        ]
        self._write(row, "stops writing its autotune log")

    def _write(self, row: list[Any], failing: str) -> None:
        """Writes one row of the log; one it cannot write (a full disk) ends the log, and
        the tuning goes on without it."""
        try:
            self._writer.writerow(row)
            self._log.flush()
        except OSError as error:
            with contextlib.suppress(Exception):  # (stderr may be closed)
                sys.stderr.write(
                    f"hvdrun: rank 0 {failing}: {error.strerror or error}: {self._log.name}\n"
                )
            self.close()

    def close(self) -> None:
        if self._log is not None:
            with contextlib.suppress(OSError):  # (what it could not write before)
                self._log.close()
            self._log = None
            self._writer = None
