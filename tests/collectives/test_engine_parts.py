"""The engine's pure parts, without processes: signatures and mismatch messages, the
negotiation exchange, fusion planning and the timeline writer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from collectives.common import ReduceOp
from collectives.engine import eager
from collectives.engine.fusion import Work, plan
from collectives.engine.handles import Handle
from collectives.engine.negotiation import FLAG_LEAVING, Entry, Exchange, Table, check
from collectives.engine.reduction import Reduction
from collectives.engine.requests import (
    Kind,
    Request,
    TensorSpec,
    check_alltoall,
    describe_mismatch,
    parse_signature,
    signature,
)
from collectives.engine.timeline import Timeline
from tests.collectives.conftest import REPO


def sig(kind: Kind, common: tuple[Any, ...], *tensors: torch.Tensor) -> str:
    return signature(kind, common, list(tensors))


def test_signature_round_trip() -> None:
    text = sig(Kind.ALLREDUCE, (1, 0.5, 2.0), torch.ones(2, 3), torch.ones(4, dtype=torch.int8))
    parsed = parse_signature(Kind.ALLREDUCE, text)
    assert parsed.reduction() == Reduction(1, 0.5, 2.0) == (1, 0.5, 2.0)
    assert [(t.dtype, t.shape, t.device_type) for t in parsed.tensors] == [
        (torch.float32, (2, 3), "cpu"),
        (torch.int8, (4,), "cpu"),
    ]
    gathered = parse_signature(Kind.ALLGATHER, sig(Kind.ALLGATHER, (), torch.ones(5, 3)))
    assert gathered.tensors[0].shape == (-1, 3)


def test_mismatch_messages_name_the_op_the_field_and_the_ranks() -> None:
    shapes = {r: sig(Kind.ALLREDUCE, (1, 1.0, 1.0), torch.ones(2 if r else 3)) for r in range(3)}
    message = describe_mismatch(Kind.ALLREDUCE, "allreduce.grad.w", shapes)
    assert message == (
        "allreduce 'grad.w': ranks disagree on the shape: rank 0: [3]; ranks 1, 2: [2]"
    )
    ops = {r: sig(Kind.ALLREDUCE, (r % 2, 1.0, 1.0), torch.ones(2)) for r in range(2)}
    assert "the op: rank 0: Average; rank 1: Sum" in describe_mismatch(Kind.ALLREDUCE, "x", ops)
    roots = {r: sig(Kind.BROADCAST, (r,), torch.ones(2)) for r in range(2)}
    assert "root_rank: rank 0: 0; rank 1: 1" in describe_mismatch(Kind.BROADCAST, "x", roots)
    counts = {r: sig(Kind.ALLREDUCE, (1, 1.0, 1.0), *[torch.ones(1)] * (r + 1)) for r in range(2)}
    assert "number of tensors" in describe_mismatch(Kind.ALLREDUCE, "x", counts)
    dtypes = {
        0: sig(Kind.ALLGATHER, (), torch.ones(1), torch.ones(2)),
        1: sig(Kind.ALLGATHER, (), torch.ones(1), torch.ones(2, dtype=torch.float64)),
    }
    message = describe_mismatch(Kind.ALLGATHER, "allgather.g", dtypes)
    assert message == (
        "allgather 'g': ranks disagree on the dtype of tensor 1: rank 0: float32; rank 1: float64"
    )
    devices = {0: sig(Kind.ALLREDUCE, (1, 1.0, 1.0), torch.ones(1)),
               1: sig(Kind.ALLREDUCE, (1, 1.0, 1.0), torch.ones(1, device="meta"))}  # fmt: skip
    assert "device type: rank 0: cpu; rank 1: meta" in describe_mismatch(
        Kind.ALLREDUCE, "x", devices
    )
    # An unnamed op's says how unnamed ops pair up; a bucket of DistributedOptimizer without
    # named_parameters (allreduce.noname.0.0+1, as Horovod names it) is no unnamed op.
    unnamed = describe_mismatch(Kind.ALLREDUCE, "allreduce.noname.7", shapes)
    assert "it is each rank's unnamed allreduce number 7 (counted from 0" in unnamed
    assert "The op has no name" not in describe_mismatch(
        Kind.ALLREDUCE, "allreduce.noname.0.0+1", shapes
    )


def test_alltoall_splits_are_checked_for_every_rank() -> None:
    members = [0, 1, 2]
    assert check_alltoall("a", members, {0: "3/1,1,1", 1: "2/0,2,0", 2: "0/0,0,0"}) is None
    assert check_alltoall("a", members, {0: "3/", 1: "6/"}) is None
    message = check_alltoall("alltoall.a", members, {0: "3/1,1,1", 1: "2/1,1"})
    assert message == (
        "alltoall 'a': rank 1 passed 2 splits [1, 1], but the process set has 3 ranks"
    )
    message = check_alltoall("a", members, {0: "3/1,1,2"})
    assert message is not None and "sum to its tensor's first dimension 3" in message
    message = check_alltoall("a", members, {2: "4/"})
    assert message is not None and "do not split evenly over 3 ranks" in message


class FakeGroup:
    """A 'process group' whose peers all send exactly what this rank sends."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = 0

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        self.calls += 1
        out.copy_(inp.repeat(self.size))
        return self

    def wait(self) -> None:
        return None


def test_exchange_small_and_overflowing_payloads() -> None:
    group = FakeGroup(3)
    exchange = Exchange(group, rank=0, size=3)
    assert exchange.round(b"hello", FLAG_LEAVING) == [(FLAG_LEAVING, b"hello")] * 3
    assert group.calls == 1
    big = bytes(range(256)) * 40  # 10 KB: more than the first slot
    assert exchange.round(big, 0) == [(0, big)] * 3
    assert group.calls == 3  # the overflow took a second round...
    assert exchange.round(big, 0) == [(0, big)] * 3
    assert group.calls == 4  # ...and the slot has grown for the next cycles
    assert exchange.round(b"", 0) == [(0, b"")] * 3
    grown = exchange._slot
    assert grown == 16384
    for _ in range(126):  # a run of 128 small rounds shrinks the slot again, to fit them...
        exchange.round(b"tiny", 0)
    assert exchange._slot == grown
    exchange.round(b"tiny", 0)
    assert exchange._slot == 512
    exchange.round(b"", 0, want=300_000)  # ...and it grows for a payload a rank wanted
    assert exchange._slot == 512 * 1024 and exchange.wants == [300_000] * 3
    for _ in range(4):  # a large slot shrinks sooner
        exchange.round(b"tiny", 0)
    assert exchange._slot == 512


def test_exchange_carries_data_after_the_payload_and_reports_wants() -> None:
    group = FakeGroup(2)
    exchange = Exchange(group, rank=0, size=2)
    data = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3], dtype=torch.uint8)]
    assert exchange.round(b"ab", 0, data=data, want=5) == [(0, b"ab\x01\x02\x03")] * 2
    assert exchange.wants == [5, 5]
    with pytest.raises(ValueError, match="do not fit"):
        exchange.round(b"", 0, data=[torch.zeros(exchange.room + 1, dtype=torch.uint8)])
    # Data too large for the slot travels in an allgather of exactly its size.
    parts = exchange.gather([torch.arange(4, dtype=torch.uint8)], 4, None)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3]] * 2


def _request(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, scale: float = 1.0) -> Request:
    reduction = Reduction(int(op), scale, 1.0)
    return Request(
        Kind.ALLREDUCE, "allreduce.x", 0, [tensor], [None], Handle(), reduction,
        sig=sig(Kind.ALLREDUCE, reduction, tensor),
        specs=[TensorSpec.of(tensor.dtype, tuple(tensor.shape), "cpu")],
    )  # fmt: skip


def test_eager_riders_all_or_nothing_and_local_reduction() -> None:
    small = [_request(torch.full((2, 2), 1.0)), _request(torch.tensor(3, dtype=torch.int32))]
    odd = _request(torch.ones(2, dtype=torch.int16))  # int16 cannot ride (Gloo upcasts it)
    riders = eager.select(b"rec", [*small, odd], room=100, limit=64)
    assert riders.requests == small and riders.nbytes == 20 and riders.inline
    assert not eager.select(b"rec", small, room=10, limit=64).inline  # ask for the allgather
    assert eager.select(b"rec", small, room=100, limit=16).requests == []  # over the budget
    # Two ranks' data: rank 0 sent the requests' inputs, rank 1 twice as much.
    mine = torch.cat([t.view(torch.uint8) for t in riders.tensors()])
    peer = torch.cat([torch.full((4,), 2.0).view(torch.uint8),
                      torch.tensor([6], dtype=torch.int32).view(torch.uint8)])  # fmt: skip
    # Every rank decides alike how the data arrived: in the slot, following it, or not at all.
    assert eager.delivery(riders, [b"x" * 20] * 2, [riders.want] * 2) == eager.INLINE
    assert eager.delivery(riders, [b"x" * 20, b""], [riders.want] * 2) is None
    follow = eager.select(b"rec", small, room=10, limit=64)
    assert eager.delivery(follow, [b"", b""], [follow.want] * 2) == eager.FOLLOW
    assert eager.delivery(follow, [b"", b""], [follow.want, 7]) is None
    eager.reduce_locally(riders, [mine, peer])
    assert torch.equal(small[0].outputs[0], torch.full((2, 2), 3.0))
    assert small[1].outputs[0].dtype == torch.int32 and small[1].outputs[0].item() == 9
    assert eager.budget(size=3, fusion_threshold=1 << 30) == eager.BUDGET_BYTES // 2
    assert eager.budget(size=2, fusion_threshold=100) == 100


def test_table_readiness_with_joined_ranks() -> None:
    table = Table(size=3)
    record = "\x1f".join(["0", "0", "allreduce.x", sig(Kind.ALLREDUCE, (1, 1.0, 1.0),
                                                          torch.ones(2)), ""])  # fmt: skip
    touched, _ = table.add(0, record.encode(), cycle=1, now=0.0)
    entry = touched[0]
    assert table.waiting_for(entry, [0, 1, 2]) == [1, 2]
    table.add(1, "\x1f".join(["6", "0", "join.join", "", ""]).encode(), cycle=1, now=0.0)
    assert table.waiting_for(entry, [0, 1, 2]) == [2]
    table.add(2, record.encode(), cycle=2, now=0.0)
    assert table.waiting_for(entry, [0, 1, 2]) == []
    assert check(entry, [0, 1, 2], table.joined) is None


def test_ops_join_does_not_support_are_refused_while_a_rank_has_joined() -> None:
    from collectives.errors import (
        CollectiveError,
        HorovodInternalError,
        NotSupportedWithJoinError,
    )

    table = Table(size=3)
    table.add(0, "\x1f".join(["6", "0", "join.join", "", ""]).encode(), cycle=1, now=0.0)
    cases = [
        (Kind.ALLGATHER, (), torch.ones(2, 1), "2"),
        (Kind.BROADCAST, (1,), torch.ones(2), ""),
        (Kind.ALLTOALL, (), torch.ones(6), "6/"),
        (Kind.REDUCESCATTER, (1, 1.0, 1.0), torch.ones(6), ""),
    ]
    for kind, common, tensor, var in cases:
        record = "\x1f".join(["", "0", f"{kind.label}.x", sig(kind, common, tensor), var])
        entry = None
        for rank in (1, 2):
            touched, _ = table.add(rank, f"{int(kind)}{record}".encode(), cycle=2, now=0.0)
            entry = touched[0]
        assert entry is not None and table.waiting_for(entry, [0, 1, 2]) == []
        error = check(entry, [0, 1, 2], table.joined)
        assert isinstance(error, NotSupportedWithJoinError), (kind, error)
        assert isinstance(error, CollectiveError) and isinstance(error, RuntimeError)
        assert not isinstance(error, HorovodInternalError)
        assert f"{kind.label} 'x'" in str(error) and "[0]" in str(error)
        # A set without the joined rank is not affected.
        assert check(entry, [1, 2], table.joined) is None
        table.pop(entry)
    # An Adasum allreduce travels as an allgather, and is named as what the script called.
    signature = sig(Kind.ALLGATHER, (), torch.ones(2))
    record = "\x1f".join(["1", "0", "allgather.adasum.allreduce.g", signature, "2"])
    touched, _ = table.add(1, record.encode(), cycle=2, now=0.0)
    error = check(touched[0], [0, 1, 2], table.joined)
    assert isinstance(error, NotSupportedWithJoinError)
    assert "Adasum allreduce cannot run" in str(error) and "allgather" not in str(error), error
    assert "'g'" in str(error) and "sparse" not in str(error)
    table.pop(touched[0])
    record = "\x1f".join(["0", "0", "allreduce.y", sig(Kind.ALLREDUCE, (1, 1.0, 1.0),
                                                          torch.ones(2)), ""])  # fmt: skip
    touched, _ = table.add(1, record.encode(), cycle=2, now=0.0)
    assert check(touched[0], [0, 1, 2], table.joined) is None  # allreduce goes on


def test_root_mismatch_in_a_process_set_names_global_ranks() -> None:
    from collectives.errors import TensorMismatchError

    # Set [1, 3]: rank 1 passed root_rank=1 (position 0), rank 3 root_rank=3 (position 1).
    entry = Entry(Kind.BROADCAST, "broadcast.b", 1, (1, "broadcast.b"), 0, 0.0)
    entry.sigs = {1: sig(Kind.BROADCAST, (0,), torch.ones(2)), 3: sig(Kind.BROADCAST, (1,),
                                                                       torch.ones(2))}  # fmt: skip
    error = check(entry, [1, 3], {})
    assert isinstance(error, TensorMismatchError)
    assert str(error) == "broadcast 'b': ranks disagree on the root_rank: rank 1: 1; rank 3: 3"


def _work(name: str, order: int, kind: Kind, common: tuple[Any, ...], *tensors: torch.Tensor,
          set_id: int = 0) -> Work:  # fmt: skip
    text = sig(kind, common, *tensors)
    vars_ = {0: ",".join(str(t.shape[0]) for t in tensors)} if kind == Kind.ALLGATHER else {}
    if kind == Kind.ALLTOALL:
        vars_ = {0: f"{tensors[0].shape[0]}/"}
    return Work.joined(kind, name, set_id, text, vars_, order)


def test_fusion_plan_groups_by_key_and_threshold() -> None:
    reduce_sum = (1, 1.0, 1.0)
    works = [
        _work("a", 0, Kind.ALLREDUCE, reduce_sum, torch.ones(100)),  # 400 bytes
        _work("b", 1, Kind.ALLREDUCE, reduce_sum, torch.ones(100, dtype=torch.float64)),
        _work("c", 2, Kind.ALLREDUCE, reduce_sum, torch.ones(100)),
        _work("d", 3, Kind.ALLREDUCE, (0, 1.0, 1.0), torch.ones(100)),  # Average: apart
        _work("e", 4, Kind.ALLREDUCE, reduce_sum, torch.ones(100)),  # over 1000 bytes
        _work("f", 5, Kind.ALLREDUCE, reduce_sum, torch.ones(1000)),  # alone, in place
        _work("g", 6, Kind.ALLGATHER, (), torch.ones(2), torch.ones(3, dtype=torch.int8)),
        _work("h", 7, Kind.ALLTOALL, (), torch.ones(2)),
        _work("i", 8, Kind.ALLTOALL, (), torch.ones(2)),
        _work("j", 9, Kind.ALLREDUCE, reduce_sum, torch.ones(10), set_id=1),
    ]
    buckets = plan(works, {0: [0], 1: [0]}, threshold=1000)
    layout = [[(s.work.name, s.index) for s in b.slots] for b in buckets]
    assert layout == [
        [("a", 0), ("c", 0)],
        [("b", 0)],
        [("d", 0)],
        [("e", 0)],
        [("f", 0)],
        [("g", 0), ("g", 1)],
        [("h", 0)],
        [("i", 0)],
        [("j", 0)],
    ]
    assert [w.remaining for w in works] == [1, 1, 1, 1, 1, 1, 2, 1, 1, 1]
    no_fusion = plan([_work(n, i, Kind.ALLREDUCE, reduce_sum, torch.ones(1))
                      for i, n in enumerate("xyz")], {0: [0]}, threshold=0)  # fmt: skip
    assert len(no_fusion) == 3


def _cuda_work(name: str, order: int, kind: Kind, *numels: int) -> Work:
    specs = [TensorSpec.of(torch.float32, (n,), "cuda") for n in numels]
    return Work(kind, name, 0, None, Reduction(1, 1.0, 1.0), 0, specs, {}, order)


def test_cuda_reductions_have_a_fusion_threshold_of_their_own() -> None:
    # A bucket waits on the GPU for the last of its tensors: DistributedOptimizer's 1 MB
    # and 25 MB gradient buckets stay apart (each starts once its gradients exist) under a
    # small CUDA threshold, though the fusion threshold would pack them into one.
    mb = 1 << 18  # float32 elements of 1 MiB
    works = [
        _cuda_work("first", 0, Kind.ALLREDUCE, mb),
        _cuda_work("second", 1, Kind.ALLREDUCE, 25 * mb),
        _cuda_work("third", 2, Kind.ALLREDUCE, 18 * mb),
        _cuda_work("small1", 3, Kind.ALLREDUCE, 1024),
        _cuda_work("small2", 4, Kind.ALLREDUCE, 1024),
        _cuda_work("gathered", 5, Kind.ALLGATHER, mb),
        _cuda_work("gathered2", 6, Kind.ALLGATHER, mb),
    ]
    members = {0: [0]}
    cap = 4 << 20
    layout = [[s.work.name for s in b.slots] for b in plan(works, members, 128 << 20, cap)]
    assert layout == [
        ["first"],
        ["second"],
        ["third"],
        ["small1", "small2"],  # (small CUDA tensors still fuse)
        ["gathered", "gathered2"],  # (only reductions: an allgather keeps the threshold)
    ]
    for work in works:
        work.remaining = 0
    one = plan(works, members, 128 << 20)  # (no CUDA threshold: the fusion threshold's)
    assert [[s.work.name for s in b.slots] for b in one] == [
        ["first", "second", "third", "small1", "small2"],
        ["gathered", "gathered2"],
    ]


def test_a_round_of_cuda_reductions_runs_in_buckets_of_the_cuda_threshold() -> None:
    # The round's dispatch plans with the configuration's CUDA threshold (the buckets are
    # recorded instead of run: there is no GPU here).
    from collectives.engine.config import EngineConfig
    from collectives.engine.dispatch import Dispatch
    from collectives.engine.execute import Group
    from collectives.engine.queue import Submissions

    def layouts(config: EngineConfig) -> list[list[str]]:
        dispatch = Dispatch(Group(0, [0], 0), Submissions(0), None, lambda entry: None, config)
        ran: list[list[str]] = []
        dispatch.executor.run = lambda bucket: ran.append([s.work.name for s in bucket.slots])  # type: ignore[method-assign]
        mb = 1 << 18
        works = [_cuda_work(n, i, Kind.ALLREDUCE, mb, mb) for i, n in enumerate("abc")]
        dispatch.execute(works, [])
        return ran

    assert layouts(EngineConfig()) == [["a", "a", "b", "b"], ["c", "c"]]  # (4 MiB)
    assert layouts(EngineConfig(fusion_threshold=128 << 20, cuda_fusion_threshold=128 << 20)) == [
        ["a", "a", "b", "b", "c", "c"]
    ]
    assert layouts(EngineConfig(fusion_threshold=0)) == [["a"], ["a"], ["b"], ["b"], ["c"], ["c"]]


def test_settings_that_must_agree_name_the_setting_and_each_ranks_value() -> None:
    from collectives.engine.config import EngineConfig, must_agree, settings_disagreement

    alike = [must_agree(EngineConfig(), False) for _ in range(3)]
    assert settings_disagreement(alike) is None
    assert "HVDRUN_AUTOTUNE_STEPS_PER_SAMPLE" not in alike[0]  # (autotune off: not compared)
    tuned = must_agree(EngineConfig(autotune=True, autotune_warmup_samples=9), False)
    assert "HVDRUN_AUTOTUNE_STEPS_PER_SAMPLE" in tuned
    # (rank 0's own: it broadcasts what the others run)
    assert "HVDRUN_AUTOTUNE_WARMUP_SAMPLES" not in tuned
    many = [
        must_agree(EngineConfig(cache_capacity=0 if r == 4 else 1024), False) for r in range(12)
    ]
    assert settings_disagreement(many) == (
        "the ranks run with different values of HVDRUN_CACHE_CAPACITY (or "
        "HOROVOD_CACHE_CAPACITY): ranks 0, 1, 2, 3, 5, 6, 7, 8 and 3 more: 1024; rank 4: 0. "
        "Their collectives would not match: give every rank's environment the same settings "
        "(hvdrun passes its own to every rank; mpirun needs -x for each)"
    )
    assert "HVDRUN_AUTOTUNE (or HOROVOD_AUTOTUNE): rank 0: 0; rank 1: 1" in str(
        settings_disagreement([alike[0], tuned])
    )
    # The threshold set to its default on one rank only: CUDA reductions would differ, which
    # counts where ranks have GPUs (compared among those that do).
    default, named = EngineConfig(), EngineConfig(cuda_fusion_threshold=128 << 20)
    assert settings_disagreement([must_agree(default, False), must_agree(named, False)]) is None
    gpus = [must_agree(default, True), must_agree(named, True)]
    assert "CUDA reductions (4 MiB unless HVDRUN_FUSION_THRESHOLD is set): rank 0: 4194304; " \
        "rank 1: 134217728" in str(settings_disagreement(gpus))  # fmt: skip
    mixed = [must_agree(default, True), must_agree(named, False), must_agree(default, True)]
    assert settings_disagreement(mixed) is None


def test_a_setup_error_is_not_retried_by_an_elastic_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from collectives.errors import SettingsMismatchError
    from collectives.runtime import registration

    def refuse(runtime_: object) -> None:
        raise SettingsMismatchError("hvd.init(): the ranks run with different values")

    registered: list[object] = []
    monkeypatch.setattr(registration, "_bootstrap", lambda runtime_, attempts: None)
    monkeypatch.setattr(registration, "start_engine", refuse)
    monkeypatch.setattr(registration, "register", lambda *args: registered.append(args))
    with pytest.raises(SettingsMismatchError):
        registration.join_elastic(SimpleNamespace(generation=1))  # type: ignore[arg-type]
    assert registered == []  # (no next generation waited for)


def test_a_bucket_on_another_stream_waits_for_the_previous_one() -> None:
    # Buckets share the fusion buffer: one on another stream than the previous bucket's
    # starts after that one's end; on the same stream, the stream's order suffices.
    from collectives.engine.streams import after_previous

    class Stream:
        def __init__(self) -> None:
            self.waited: list[object] = []

        def wait_event(self, event: object) -> None:
            self.waited.append(event)

    engine, caller, event = Stream(), Stream(), object()
    after_previous(caller, None)
    after_previous(caller, (caller, event))
    assert caller.waited == []
    after_previous(caller, (engine, event))
    assert caller.waited == [event]


def test_the_cuda_fusion_threshold_is_the_fusion_threshold_once_one_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from collectives.engine.config import DEFAULT_CUDA_FUSION_THRESHOLD, from_environment

    for name in ("HVDRUN_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"):
        monkeypatch.delenv(name, raising=False)
    config = from_environment()
    assert config.fusion_threshold == 128 << 20
    assert config.cuda_fusion_threshold == DEFAULT_CUDA_FUSION_THRESHOLD == 4 << 20
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(64 << 20))
    assert from_environment().cuda_fusion_threshold == 64 << 20
    monkeypatch.setenv("HVDRUN_FUSION_THRESHOLD", str(1 << 20))
    config = from_environment()
    assert (config.fusion_threshold, config.cuda_fusion_threshold) == (1 << 20, 1 << 20)
    monkeypatch.setenv("HVDRUN_FUSION_THRESHOLD", "0")  # (0: no fusion, CUDA too)
    assert from_environment().cuda_fusion_threshold == 0


def test_timeline_is_valid_json_after_every_flush(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    timeline = Timeline(str(path), mark_cycles=True)
    assert json.loads(path.read_text()) == []
    timeline.begin("grad.w", "NEGOTIATE_ALLREDUCE", 1.0)
    timeline.cycle(1.0)
    timeline.flush()
    first = json.loads(path.read_text())
    assert any(e["name"] == "CYCLE_START" for e in first)
    timeline.tick("grad.w", "1", 1.5)
    timeline.end("grad.w", "NEGOTIATE_ALLREDUCE", 2.0)
    timeline.end("grad.w", "NEGOTIATE_ALLREDUCE", 2.5)  # nothing open: ignored
    timeline.begin("grad.w", "ALLREDUCE", 1.9)  # never earlier than the row's last event
    timeline.flush()
    second = json.loads(path.read_text())
    assert len(second) > len(first)
    timeline.close()  # ends ALLREDUCE, still open
    events = json.loads(path.read_text())
    row = [e for e in events if e["ph"] in "BEi" and e.get("pid") == 1]
    assert [(e["name"], e["ph"]) for e in row] == [
        ("NEGOTIATE_ALLREDUCE", "B"),
        ("1", "i"),
        ("NEGOTIATE_ALLREDUCE", "E"),
        ("ALLREDUCE", "B"),
        ("ALLREDUCE", "E"),
    ]
    stamps = [e["ts"] for e in row]
    assert stamps == sorted(stamps)
    timeline.begin("late", "X", 3.0)  # after close: ignored, the file stays complete
    assert json.loads(path.read_text()) == events


_FULL_DISK = """
import json, os, resource, signal, sys, time
from collectives.engine.timeline import Timeline
from tests.collectives.conftest import REPO
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails: EFBIG)
path = sys.argv[1]
timeline = Timeline(path, rank=3)
timeline.begin("grad.w", "NEGOTIATE_ALLREDUCE", time.monotonic())
timeline.flush()
written = json.load(open(path))
room = os.path.getsize(path) + 100
resource.setrlimit(resource.RLIMIT_FSIZE, (room, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
for step in range(100):
    timeline.begin(f"grad.{step}", "NEGOTIATE_ALLREDUCE", time.monotonic())
timeline.flush()  # does not fit: recording ends
timeline.begin("late", "NEGOTIATE_ALLREDUCE", time.monotonic())
timeline.flush()
timeline.close()
assert json.load(open(path)) == written, open(path).read()
print("SAME AS BEFORE", len(written))
"""


def test_a_timeline_that_cannot_be_written_ends_and_stays_valid(tmp_path: Path) -> None:
    # Horovod stops writing a timeline it cannot write and trains on: a full disk, or a
    # file size limit (here), must not fail the engine and with it the job.
    path = tmp_path / "t.json"
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(path)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "SAME AS BEFORE" in result.stdout, result.stdout
    assert result.stderr.count("hvdrun: rank 3 stops writing its timeline") == 1, result.stderr
    assert "File too large; the job runs on without it" in result.stderr, result.stderr


def test_one_op_name_in_two_process_sets_is_two_timeline_rows(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    glob, one, two = (_request(torch.ones(2)) for _ in range(3))
    one.process_set_id, two.process_set_id = 1, 2
    assert glob.row == "allreduce.x"
    timeline.begin(one.row, "NEGOTIATE_ALLREDUCE", 1.0)
    timeline.begin(two.row, "NEGOTIATE_ALLREDUCE", 1.1)
    timeline.negotiated(one.row, "ALLREDUCE", {0: 1.0, 1: 1.2}, 1.2, "1:1")
    timeline.end(two.row, "QUEUE", 1.3)  # set 2's op is not queued yet: nothing to end
    timeline.end(one.row, "QUEUE", 1.3)
    timeline.end(one.row, "ALLREDUCE", 1.4)
    timeline.close()
    events = json.loads(path.read_text())
    rows = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert set(rows) == {
        "negotiation cycles", "allreduce.x (process set 1)", "allreduce.x (process set 2)",
    }  # fmt: skip
    ended = [
        e for e in events if e.get("pid") == rows["allreduce.x (process set 1)"] and e["ph"] == "E"
    ]
    assert [e["name"] for e in ended] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE"]


def test_entry_key_matches_table_key() -> None:
    entry = Entry(Kind.BARRIER, "barrier.noname.0", 2, (2, "barrier.noname.0"), 0, 0.0)
    assert entry.key == (entry.process_set_id, entry.name)


def test_process_set_mismatch_says_to_call_in_the_same_order_not_to_name_the_op() -> None:
    # add_process_set()/remove_process_set() take no name=: the hint for unnamed ops misleads
    ranks = {r: sig(Kind.ADD_PROCESS_SET, ("0,1" if r == 0 else "0,2",)) for r in range(3)}
    message = describe_mismatch(Kind.ADD_PROCESS_SET, "add_process_set.noname.0", ranks)
    assert message == (
        "add_process_set 'noname.0': ranks disagree on the ranks: rank 0: '0,1'; ranks 1, 2: "
        "'0,2'. Every rank must call hvd.add_process_set() for the same process sets in the "
        "same order"
    )
    ids = {r: sig(Kind.REMOVE_PROCESS_SET, (1 + r % 2,)) for r in range(2)}
    message = describe_mismatch(Kind.REMOVE_PROCESS_SET, "remove_process_set.noname.3", ids)
    assert "name=" not in message
    assert message.endswith("hvd.remove_process_set() for the same process sets in the same order")
