"""Worker for the response cache and out-of-place tests (2 ranks; run with and without the
cache and with a capacity of 1): repeated steps of named, unnamed, riding, fused and large
out-of-place ops give exact results, the cache takes over the steady state when it is on,
and a mismatch after the cache learnt an op still raises the same error."""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks

import collectives.torch as hvd
from collectives import runtime

BIG = 5 * 1024 * 1024 // 4  # 5 MiB of float32: a pooled out-of-place result


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checks = Checks()
    ranks = torch.arange(size, dtype=torch.float64)
    capacity = runtime.engine().config.cache_capacity
    print(f"CAPACITY {capacity}", flush=True)

    def step(i: int) -> None:
        # Named grads, an unnamed scalar, a riding Average, an int allgather, a broadcast.
        grads = [torch.full((3, 4), float(rank + i + k)) for k in range(3)]
        handles = [
            hvd.allreduce_async_(g, name=f"grad.{k}", op=hvd.Sum) for k, g in enumerate(grads)
        ]
        loss = hvd.allreduce(torch.tensor([float(rank * i)]), op=hvd.Sum)
        mean = hvd.allreduce(torch.tensor([rank + 0.5, 1.0]), name="metric")
        gathered = hvd.allgather(torch.full((2,), rank + i, dtype=torch.int32), name="ids")
        root = hvd.broadcast(torch.tensor([rank + i]), root_rank=1, name="seed")
        for k, handle in enumerate(handles):
            want = float(sum(r + i + k for r in range(size)))
            checks.expect(f"step.{i}.grad.{k}", bool((hvd.synchronize(handle) == want).all()))
        checks.equal(f"step.{i}.unnamed", loss, torch.tensor([float(ranks.sum() * i)]))
        expected_mean = torch.tensor([float(ranks.mean()) + 0.5, 1.0])
        checks.equal(f"step.{i}.average", mean, expected_mean)
        want_ids = torch.tensor([r + i for r in range(size) for _ in range(2)], dtype=torch.int32)
        checks.equal(f"step.{i}.allgather", gathered, want_ids)
        checks.equal(f"step.{i}.broadcast", root, torch.tensor([1 + i]))

    for i in range(8):
        step(i)
    # With autotune: on until it settled (a sample lasts about half a second).
    for i in range(8, 2000):
        # Ranks see the tuner settle at slightly different moments: agree on it.
        tuning = torch.tensor([float(runtime.engine().autotuning)])
        if not hvd.allreduce(tuning, op=hvd.Max, name="still.tuning").item():
            break
        step(i)
    print(f"AUTOTUNING {runtime.engine().autotuning}", flush=True)

    def large() -> None:
        # Out of place, large enough for the pool: Sum, Average, prescale; the inputs stay.
        for i in range(3):
            x = torch.full((BIG,), float(rank + 1 + i))
            total = float(sum(r + 1 + i for r in range(size)))
            summed = hvd.allreduce(x, op=hvd.Sum, name="big")
            averaged = hvd.allreduce(x, op=hvd.Average, name="big.avg")
            scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, name="big.pre")
            checks.expect(f"large.{i}.sum", bool((summed == total).all()))
            checks.expect(f"large.{i}.average", bool((averaged == total / size).all()))
            checks.expect(f"large.{i}.prescale", bool((scaled == 2 * total).all()))
            checks.expect(f"large.{i}.input_kept", bool((x == rank + 1 + i).all()))
            del summed, averaged, scaled

    checks.run("large", large)

    def repeated_riders() -> None:
        # The steady state of one small op: the same op round after round rides a reused
        # buffer; every result stays its own (float64 included, where a cast is no copy).
        results = []
        for i in range(12):
            x = torch.tensor([float(rank + i), 2.0], dtype=torch.float64)
            results.append(hvd.allreduce(x, op=hvd.Average, name="rider.avg"))
        summed = [
            hvd.allreduce_(torch.full((2, 2), float(rank + i)), op=hvd.Sum) for i in range(12)
        ]
        for i, (mean, total) in enumerate(zip(results, summed, strict=True)):
            want = float(ranks.mean()) + i
            checks.expect(
                f"riders.{i}",
                bool((mean == torch.tensor([want, 2.0], dtype=torch.float64)).all())
                and bool((total == float(ranks.sum()) + size * i).all()),
                (mean, total),
            )

    checks.run("riders", repeated_riders)

    def parameters_in_place() -> None:
        # In place on a leaf that requires grad (a Parameter), as torch.distributed allows:
        # the full negotiation, the cache's rounds and the fast lane alike; the result is
        # exact, the Parameter stays a leaf and the caller's grad mode is as it was.
        param = torch.nn.Parameter(torch.zeros(3))
        for i in range(8):
            with torch.no_grad():
                param.fill_(float(rank + i))
            hvd.allreduce_(param, op=hvd.Sum)
            checks.expect(
                f"parameter.{i}",
                bool((param == float(ranks.sum()) + size * i).all())
                and param.requires_grad
                and param.grad_fn is None
                and torch.is_grad_enabled(),
                (param, torch.is_grad_enabled()),
            )
        with torch.no_grad():
            hvd.allreduce_(param, op=hvd.Sum)
            checks.expect("parameter.no_grad", not torch.is_grad_enabled(), "grad enabled")

    checks.run("parameter", parameters_in_place)

    def diverging_lane() -> None:
        # A lone op repeated in a loop takes the fast lane; when one rank's next cycle holds
        # other ops too, the lane's round falls back to the full negotiation on every rank.
        t = torch.zeros(2)
        for i in range(6):
            t.fill_(float(rank + i))
            hvd.allreduce_(t, op=hvd.Sum)
        other = torch.full((3,), float(rank + 1))
        t.fill_(float(rank))
        if rank == 0:
            hvd.allreduce_(t, op=hvd.Sum)  # the predicted op
            hvd.allreduce_(other, op=hvd.Sum, name="lane.other")
        else:
            handle = hvd.allreduce_async_(other, op=hvd.Sum, name="lane.other")
            hvd.allreduce_(t, op=hvd.Sum)
            hvd.synchronize(handle)
        checks.expect(
            "lane.fallback",
            bool((t == float(ranks.sum())).all())
            and bool((other == float(ranks.sum() + size)).all()),
            (t, other),
        )

    checks.run("lane", diverging_lane)

    def diverging_lane_out_of_place() -> None:
        # The same with an out-of-place allreduce as the predicted op (the lane of a request,
        # not the in-place hot lane).
        for i in range(6):
            hvd.allreduce(torch.full((2,), float(rank + i)), op=hvd.Sum, name="lane.out")
        other = torch.full((3,), float(rank + 1))
        mine = torch.full((2,), float(rank))
        if rank == 0:
            result = hvd.allreduce(mine, op=hvd.Sum, name="lane.out")
            hvd.allreduce_(other, op=hvd.Sum, name="lane.out.other")
        else:
            handle = hvd.allreduce_async_(other, op=hvd.Sum, name="lane.out.other")
            result = hvd.allreduce(mine, op=hvd.Sum, name="lane.out")
            hvd.synchronize(handle)
        checks.expect(
            "lane.fallback.out",
            bool((result == float(ranks.sum())).all())
            and bool((other == float(ranks.sum() + size)).all())
            and bool((mine == rank).all()),
            (result, other),
        )

    checks.run("lane.out", diverging_lane_out_of_place)

    def hot_lane() -> None:
        # allreduce_ repeated in a loop runs in the hot lane: named and unnamed, Average
        # with pre- and postscaling, a new tensor of the same shape each call; exact results.
        engine = runtime.engine()
        before = engine.stats["hot_rounds"]
        for i in range(10):
            t = torch.full((3,), float(rank + i), dtype=torch.float64)
            hvd.allreduce_(
                t, op=hvd.Average, prescale_factor=2.0, postscale_factor=3.0, name="hot.avg"
            )
            want = 6.0 * (float(ranks.mean()) + i)
            checks.expect(f"hot.average.{i}", bool((t == want).all()), t)
        for i in range(10):
            t = torch.full((2,), float(rank * i), dtype=torch.float32)
            hvd.allreduce_(t, op=hvd.Sum)
            checks.expect(f"hot.unnamed.{i}", bool((t == float(ranks.sum()) * i).all()), t)
        hot = engine.stats["hot_rounds"] - before
        if engine.response_cache is not None and not engine.config.autotune:
            checks.expect("hot.used", hot >= 10, engine.stats)
        # Out of place, a small op with no autograd to record (a metric, as Horovod's
        # examples average theirs) takes the hot lane too: a new result every call, the
        # input kept; one that requires grad still records its backward.
        before = engine.stats["hot_rounds"]
        for i in range(8):
            metric = torch.tensor([float(rank + i), 1.0])
            mean = hvd.allreduce(metric, name="hot.metric")
            checks.expect(
                f"hot.out.{i}",
                mean.tolist() == [float(ranks.mean()) + i, 1.0]
                and metric.tolist() == [float(rank + i), 1.0]
                and mean.data_ptr() != metric.data_ptr()
                and mean.grad_fn is None,
                (metric, mean),
            )
        if engine.response_cache is not None and not engine.config.autotune:
            checks.expect("hot.out.used", engine.stats["hot_rounds"] - before >= 4, engine.stats)
        weight = torch.ones(2, requires_grad=True)
        hvd.allreduce(weight * (rank + 1), op=hvd.Sum, name="hot.grad").sum().backward()
        checks.expect(
            "hot.out.grad",
            weight.grad is not None
            and weight.grad.tolist() == [float(size * (rank + 1))] * 2,  # (Sum's backward)
            weight.grad,
        )
        # A refused unnamed op still takes its counter: the next one in the lane is not the
        # op predicted, and goes on as usual; then the lane takes over again.
        try:
            hvd.grouped_allreduce([torch.ones(1), torch.ones(1, device="meta")], op=hvd.Sum)
            checks.expect("hot.refused", False, "no error")
        except ValueError as error:
            checks.expect("hot.refused", "same device" in str(error), error)
        for i in range(6):
            t = torch.full((2,), float(rank + i), dtype=torch.float32)
            hvd.allreduce_(t, op=hvd.Sum)
            checks.expect(f"hot.skipped.{i}", bool((t == float(ranks.sum()) + size * i).all()), t)
            # Another op on the same tensor does not take the lane of the first.
            hvd.allreduce_(t, op=hvd.Average)
            want = float(ranks.sum()) + size * i
            checks.expect(f"hot.other.{i}", bool((t == want).all()), t)

    checks.run("hot", hot_lane)

    def direct_lanes() -> None:
        # Blocking ops whose data cannot ride a round, repeated: once predicted, the lanes
        # run their collectives on the caller's thread (the hot lane on the tensor itself):
        # integers with an Average that truncates and a prescale, a tensor larger than a
        # round carries, one large enough to be reduced in parts, Min; then a sync
        # broadcast and allgather. Exact results on every step, and the hot lane was used.
        engine = runtime.engine()
        before = engine.stats["hot_rounds"]
        ints = torch.zeros(5, dtype=torch.int64)
        wide = torch.zeros(20_000)  # more elements than a round carries
        parts = torch.zeros(9 * 1024 * 1024 // 4, dtype=torch.int32)  # reduced in two parts
        for i in range(8):  # (one op repeated is predicted; ops taking turns are not)
            ints.fill_(rank * 7 + i)
            hvd.allreduce_(ints, op=hvd.Average, prescale_factor=3.0, name="direct.ints")
            want = sum(3 * (r * 7 + i) for r in range(size)) // size
            checks.expect(f"direct.ints.{i}", bool((ints == want).all()), ints)
        for i in range(8):
            wide.fill_(float(rank + i))
            hvd.allreduce_(wide, op=hvd.Sum)  # unnamed
            checks.expect(f"direct.wide.{i}", bool((wide == float(ranks.sum()) + size * i).all()))
        for i in range(8):
            parts.fill_(rank - i)
            hvd.allreduce_(parts, op=hvd.Min, name="direct.parts")
            checks.expect(f"direct.parts.{i}", bool((parts == -i).all()), parts[:3])
        for i in range(6):
            seed = hvd.broadcast(torch.tensor([rank * 10 + i]), root_rank=1, name="direct.seed")
            checks.expect(f"direct.broadcast.{i}", int(seed) == 10 + i, seed)
        for i in range(6):
            ids = hvd.allgather(torch.full((2, 2), rank + i, dtype=torch.int16))
            want_ids = torch.tensor([[r + i] * 2 for r in range(size) for _ in range(2)])
            checks.expect(f"direct.allgather.{i}", torch.equal(ids, want_ids.short()), ids)
        hot = engine.stats["hot_rounds"] - before
        # (a cache of one op may still be backing off after the sections before)
        if engine.response_cache is not None and capacity > 1 and not engine.config.autotune:
            # (each loop's op is predicted from its fourth or fifth call on)
            checks.expect("direct.used", hot >= 3 * 3, engine.stats)
        # The same op in place on one rank (the hot lane) and out of place on the other
        # (the request lane, a copy on the way in): the same collectives, the same result.
        for i in range(6):
            mine = torch.full((7,), rank + i, dtype=torch.int32)
            if rank == 0:
                hvd.allreduce_(mine, op=hvd.Sum, name="direct.mixed")
                result = mine
            else:
                result = hvd.allreduce(mine, op=hvd.Sum, name="direct.mixed")
            want_sum = sum(r + i for r in range(size))
            checks.expect(f"direct.mixed.{i}", bool((result == want_sum).all()), result)
        # Predicted, but rank 1's cycle holds one more op: every rank falls back to the
        # full negotiation, the integers' collectives run once, results exact.
        other = torch.full((3,), rank + 1, dtype=torch.int64)
        ints.fill_(rank)
        if rank == 0:
            hvd.allreduce_(ints, op=hvd.Average, prescale_factor=3.0, name="direct.ints")
            hvd.allreduce_(other, op=hvd.Sum, name="direct.other")
        else:
            handle = hvd.allreduce_async_(other, op=hvd.Sum, name="direct.other")
            hvd.allreduce_(ints, op=hvd.Average, prescale_factor=3.0, name="direct.ints")
            hvd.synchronize(handle)
        checks.expect(
            "direct.fallback",
            bool((ints == sum(3 * r for r in range(size)) // size).all())
            and bool((other == sum(r + 1 for r in range(size))).all()),
            (ints, other),
        )

    checks.run("direct", direct_lanes)

    def two_threads() -> None:
        # Blocking ops on two threads at once: one thread's wait runs the cycle while the
        # other's must hand its op to the cycle in flight or the engine thread.
        import threading

        failures: list[BaseException] = []

        def other() -> None:
            # (integers: this thread's op never rides a round, the main thread's does)
            try:
                for i in range(30):
                    t = torch.tensor([rank * i], dtype=torch.int64)
                    hvd.allreduce_(t, op=hvd.Sum, name="thread.other")
                    if int(t) != int(ranks.sum()) * i:
                        raise AssertionError(f"thread.other {i}: {int(t)}")
            except BaseException as error:
                failures.append(error)

        thread = threading.Thread(target=other)
        thread.start()
        for i in range(30):
            mine = hvd.allreduce(torch.tensor([float(rank + i)]), op=hvd.Sum, name="thread.main")
            if float(mine) != float(ranks.sum()) + size * i:
                failures.append(AssertionError(f"thread.main {i}: {float(mine)}"))
        thread.join(60)
        checks.expect("threads", not failures and not thread.is_alive(), failures)

    checks.run("threads", two_threads)

    def bursts() -> None:
        # A burst of small allreduces larger than a cache round carries (24 x 1000 float32),
        # repeated: once the pattern is predicted its data rides one allreduce of its own
        # dtype. In place and Sum (one copy out for all), then out of place and Average in
        # two dimensions (views of one result); results exact, inputs kept, none aliasing.
        engine = runtime.engine()
        before = engine.stats["predicted_rounds"]
        flat = [torch.zeros(1000) for _ in range(24)]
        for i in range(6):
            for k, t in enumerate(flat):
                t.fill_(float(rank + i + k))
            handles = [
                hvd.allreduce_async_(t, op=hvd.Sum, name=f"burst.sum.{k}")
                for k, t in enumerate(flat)
            ]
            for handle in handles:
                hvd.synchronize(handle)
            want = [float(sum(r + i + k for r in range(size))) for k in range(len(flat))]
            got = [float(t[0]) for t in flat]
            exact = all(bool((t == w).all()) for t, w in zip(flat, want, strict=True))
            checks.expect(f"burst.sum.{i}", exact, (got, want))
        grids = [torch.full((40, 25), float(rank + k)) for k in range(24)]
        kept: list[list[torch.Tensor]] = []
        for i in range(6):
            for k, g in enumerate(grids):
                g.fill_(float(rank + k + i))
            handles = [
                hvd.allreduce_async(g, op=hvd.Average, name=f"burst.avg.{k}")
                for k, g in enumerate(grids)
            ]
            results = [hvd.synchronize(handle) for handle in handles]
            kept.append(results)
            exact = all(
                r.shape == (40, 25) and bool((r == float(ranks.mean()) + k + i).all())
                for k, r in enumerate(results)
            )
            exact = exact and all(bool((g == rank + k + i).all()) for k, g in enumerate(grids))
            checks.expect(f"burst.average.{i}", exact)
        # Results of earlier rounds are untouched by later ones (no shared buffer).
        checks.expect(
            "burst.kept",
            all(
                bool((r == float(ranks.mean()) + k + i).all())
                for i, results in enumerate(kept)
                for k, r in enumerate(results)
            ),
        )
        predicted = engine.stats["predicted_rounds"] - before
        if engine.response_cache is not None and len(engine.response_cache) >= 48:
            checks.expect("burst.predicted", predicted >= 4, engine.stats)
        # The burst predicted again, but rank 1's cycle holds one more op: every rank falls
        # back to the full negotiation, and the results are still exact.
        for t in flat:
            t.fill_(float(rank))
        extra = torch.full((3,), float(rank + 1))
        late = None
        if rank == 1:
            late = hvd.allreduce_async_(extra, op=hvd.Sum, name="burst.extra")
        handles = [
            hvd.allreduce_async_(t, op=hvd.Sum, name=f"burst.sum.{k}") for k, t in enumerate(flat)
        ]
        for handle in handles:
            hvd.synchronize(handle)
        if late is None:
            hvd.allreduce_(extra, op=hvd.Sum, name="burst.extra")
        else:
            hvd.synchronize(late)
        checks.expect(
            "burst.fallback",
            all(bool((t == float(ranks.sum())).all()) for t in flat)
            and bool((extra == float(ranks.sum() + size)).all()),
            (flat[0], extra),
        )

    checks.run("bursts", bursts)

    def unnamed_bursts() -> None:
        # The same burst unnamed and out of place: the k-th unnamed op of a round has a cache
        # entry of its own, so the burst is predicted as a named one is (its counters move on
        # by 24 a round). Then every other step adds one more unnamed op before the burst, so
        # its counters move on by 24 and 25 in turn: a prediction that misses falls back, and
        # results stay exact either way.
        engine = runtime.engine()
        before = engine.stats["predicted_rounds"]
        inputs = [torch.zeros(1000) for _ in range(24)]
        for i in range(12):
            for k, t in enumerate(inputs):
                t.fill_(float(rank * 3 + i + k))
            if i >= 6 and i % 2:
                extra = hvd.allreduce(torch.tensor([float(rank + i)]), op=hvd.Sum)
                checks.expect(f"burst.unnamed.extra.{i}", float(extra) == ranks.sum() + size * i)
            handles = [hvd.allreduce_async(t, op=hvd.Sum) for t in inputs]
            results = [hvd.synchronize(handle) for handle in handles]
            exact = all(
                bool((r == float(ranks.sum() * 3) + size * (i + k)).all())
                for k, r in enumerate(results)
            )
            exact = exact and all(bool((t == rank * 3 + i + k).all()) for k, t in enumerate(inputs))
            checks.expect(f"burst.unnamed.{i}", exact, [float(r[0]) for r in results])
            if i == 5 and engine.response_cache is not None and len(engine.response_cache) >= 24:
                predicted = engine.stats["predicted_rounds"] - before
                checks.expect("burst.unnamed.predicted", predicted >= 1, engine.stats)

    checks.run("unnamed bursts", unnamed_bursts)

    def taking_turns() -> None:
        # Ops that take turns, as a loop logging its metrics runs them: a loss (Average) and
        # an accuracy (float64 Sum) in turn, an allgather of ids, an unnamed in-place op and
        # a named in-place integer count: a pattern of five rounds, predicted once it
        # repeated (the lanes take each op in its turn, the in-place ones the hot lane).
        # Exact results every step; then one rank runs two of them in another order (every
        # rank falls back to the full negotiation) and both go on.
        engine = runtime.engine()
        before = engine.stats["predicted_rounds"]
        hot_before = engine.stats["hot_rounds"]
        count = torch.zeros(3, dtype=torch.int64)
        for i in range(10):
            loss = hvd.allreduce(torch.tensor([float(rank + i)]), name="turns.loss")
            accuracy = hvd.allreduce(
                torch.tensor([float(rank * i)], dtype=torch.float64), op=hvd.Sum, name="turns.acc"
            )
            ids = hvd.allgather(torch.tensor([rank, i]), name="turns.ids")
            counter = torch.full((2,), float(rank + i))
            hvd.allreduce_(counter, op=hvd.Sum)
            count.fill_(rank * 10 + i)
            hvd.allreduce_(count, op=hvd.Sum, name="turns.count")
            checks.expect(f"turns.loss.{i}", loss.tolist() == [float(ranks.mean()) + i], loss)
            want = torch.tensor([float(ranks.sum()) * i], dtype=torch.float64)
            checks.expect(f"turns.acc.{i}", torch.equal(accuracy, want), accuracy)
            want_ids = [v for r in range(size) for v in (r, i)]
            checks.expect(f"turns.ids.{i}", ids.tolist() == want_ids, ids)
            total = float(ranks.sum()) + size * i
            checks.expect(f"turns.unnamed.{i}", counter.tolist() == [total] * 2, counter)
            want_count = sum(r * 10 + i for r in range(size))
            checks.expect(f"turns.count.{i}", count.tolist() == [want_count] * 3, count)
        predicted = engine.stats["predicted_rounds"] - before
        hot = engine.stats["hot_rounds"] - hot_before
        if capacity > 1 and not engine.config.autotune:  # (one cached op cannot take turns)
            checks.expect("turns.predicted", predicted >= 25 and hot >= 10, engine.stats)
        mine = torch.tensor([float(rank + 1)])
        if rank == 0:
            accuracy = hvd.allreduce(mine, op=hvd.Sum, name="turns.acc.out.of.turn")
            loss = hvd.allreduce(mine, name="turns.loss")
        else:
            handle = hvd.allreduce_async(mine, op=hvd.Sum, name="turns.acc.out.of.turn")
            loss = hvd.allreduce(mine, name="turns.loss")
            accuracy = hvd.synchronize(handle)
        total = float(ranks.sum()) + size
        checks.expect(
            "turns.fallback",
            accuracy.tolist() == [total] and loss.tolist() == [total / size],
            (accuracy, loss),
        )

    checks.run("turns", taking_turns)

    def split_bursts() -> None:
        # A burst that the ranks' cycles split differently: rank 1 submits its second half
        # 50 ms after its first (its engine ran a cycle in between), rank 0 all at once.
        # With the cache, the ops both submitted run, and rank 0's others wait in later
        # cache rounds until rank 1 has them too, as Horovod's bit vector keeps them: once
        # the burst is cached, no full negotiation. Results exact either way.
        engine = runtime.engine()
        tensors = [torch.zeros(16) for _ in range(12)]
        fulls = []
        for i in range(8):
            before = engine.stats["full_rounds"]
            for k, t in enumerate(tensors):
                t.fill_(float(rank + i + k))
            handles = []
            for k, t in enumerate(tensors):
                if rank == 1 and k == len(tensors) // 2:
                    time.sleep(0.05)
                handles.append(hvd.allreduce_async_(t, op=hvd.Sum, name=f"split.{k}"))
            for handle in handles:
                hvd.synchronize(handle)
            want = [float(ranks.sum()) + size * (i + k) for k in range(len(tensors))]
            got = [float(t[0]) for t in tensors]
            exact = all(bool((t == w).all()) for t, w in zip(tensors, want, strict=True))
            checks.expect(f"split.{i}", exact, (got, want))
            fulls.append(engine.stats["full_rounds"] - before)
        if capacity > 1 and not engine.config.autotune:
            checks.expect("split.held", sum(fulls[4:]) == 0, fulls)

    checks.run("split", split_bursts)

    stats = runtime.engine().stats
    engine_cache = runtime.engine().response_cache
    if runtime.engine().config.autotune:
        pass  # the autotuner turns the cache on and off
    elif capacity == 0:
        checks.expect("cache.off", stats["cache_rounds"] == 0 and engine_cache is None, stats)
    else:
        assert engine_cache is not None
        if capacity > 1:  # one op at a time in the cache cannot agree on a whole step
            checks.expect("cache.used", stats["cache_rounds"] > stats["full_rounds"], stats)
        checks.expect("cache.bounded", len(engine_cache) <= capacity)
        if capacity == 1:
            checks.expect("cache.evicts", engine_cache.evictions > 0)
        print(f"STATS {stats} evictions={engine_cache.evictions}", flush=True)

    def shape_mismatch(check: str, name: str) -> None:
        # Rank r submits ``name`` as 4 + r floats: the error names the op and the shapes.
        started = time.monotonic()
        try:
            hvd.allreduce(torch.ones(4 + rank), name=name)
            checks.expect(check, False, "no error")
        except Exception as error:
            text = str(error)
            checks.expect(
                check,
                "ranks disagree on the shape" in text and name in text,
                f"{error!r} after {time.monotonic() - started:.1f} s",
            )

    # A mismatch after the op was cached: the full negotiation reports it as before.
    for _ in range(3):
        hvd.allreduce(torch.ones(4), name="shape.changes")
    shape_mismatch("mismatch.raises", "shape.changes")
    # Both shapes cached, each rank submits the other: a cache round holds them back on
    # both ranks, until they waited a second and go to the full negotiation, which names
    # the mismatch as before.
    for shape in (4, 5):
        hvd.allreduce(torch.ones(shape), name="shape.held")
    hvd.allreduce(torch.ones(1), name="shape.new")  # (a new op: no pattern predicted next)
    shape_mismatch("mismatch.held", "shape.held")
    # ... and the job goes on.
    step(100)
    engine = runtime.engine()
    cfg = engine.config
    cache_on = engine.response_cache is not None
    print(f"FINAL {cfg.fusion_threshold} {cfg.cycle_time_ms:g} {int(cache_on)}", flush=True)
    checks.finish(rank)
    hvd.shutdown()


if __name__ == "__main__":
    main()
