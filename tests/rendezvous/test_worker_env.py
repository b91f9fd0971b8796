"""The environment contract between the launcher and its workers (rendezvous.worker_env)."""

import re

import pytest

from rendezvous import worker_env
from rendezvous.slots import assign_slots


def test_setting_reads_both_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HVDRUN_GLOO_TIMEOUT_SECONDS", raising=False)
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "12")
    assert worker_env.setting("GLOO_TIMEOUT_SECONDS") == "12"
    monkeypatch.setenv("HVDRUN_GLOO_TIMEOUT_SECONDS", "7")
    assert worker_env.setting("GLOO_TIMEOUT_SECONDS") == "7"


def test_setting_from_a_given_environment() -> None:
    env = {"HVDRUN_CYCLE_TIME": "", "HOROVOD_CYCLE_TIME": "3"}
    assert worker_env.setting(worker_env.CYCLE_TIME, env) == "3"  # empty counts as unset
    assert worker_env.setting(worker_env.TIMELINE, env) is None
    assert worker_env.number(worker_env.CYCLE_TIME, 1.0, env=env) == 3.0


def test_number_errors_name_the_variable() -> None:
    with pytest.raises(ValueError, match=r"HVDRUN_CYCLE_TIME must be a number, got 'soon'"):
        worker_env.number("CYCLE_TIME", 1.0, env={"HVDRUN_CYCLE_TIME": "soon"})
    with pytest.raises(ValueError, match="must be at least 0"):
        worker_env.number("CYCLE_TIME", 1.0, env={"HVDRUN_CYCLE_TIME": "-1"})
    with pytest.raises(ValueError, match="must be greater than 0"):
        worker_env.number(
            "GLOO_TIMEOUT_SECONDS", 1.0, strict=True, env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "0"}
        )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"HOROVOD_FUSION_THRESHOLD": "abc"},
            "HOROVOD_FUSION_THRESHOLD must be a number, got 'abc'",
        ),
        ({"HOROVOD_CYCLE_TIME": "-3"}, "HOROVOD_CYCLE_TIME must be at least 0, got '-3'"),
        ({"HVDRUN_CACHE_CAPACITY": "nan"}, "HVDRUN_CACHE_CAPACITY must be a number, got 'nan'"),
        ({"HOROVOD_GLOO_TIMEOUT_SECONDS": "inf"}, "HOROVOD_GLOO_TIMEOUT_SECONDS must be a number"),
        ({"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "0"}, "must be at least 1, got '0'"),
        ({"HOROVOD_ELASTIC_TIMEOUT": "0"}, "HOROVOD_ELASTIC_TIMEOUT must be greater than 0"),
        ({"HOROVOD_AUTOTUNE": "sure"}, "HOROVOD_AUTOTUNE must be 0 or 1, got 'sure'"),
        ({"HOROVOD_CUDA_BACKEND": "mpi"}, "HOROVOD_CUDA_BACKEND must be one of nccl, gloo"),
        # "never", as often written: beyond what Gloo's millisecond timeouts hold
        (
            {"HOROVOD_GLOO_TIMEOUT_SECONDS": "9999999999"},
            "HOROVOD_GLOO_TIMEOUT_SECONDS must be at most 1e+09, got '9999999999'",
        ),
        ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "1e15"}, "must be at most 1e+09, got '1e15'"),
        ({"HOROVOD_CYCLE_TIME": "1e308"}, "HOROVOD_CYCLE_TIME must be at most 1e+09"),
        # a cycle as long as the timeout: ranks waiting a cycle would count peers as dead
        (
            {"HOROVOD_CYCLE_TIME": "60000"},
            "HOROVOD_CYCLE_TIME=60000 ms is not shorter than the collectives' timeout (30 s)",
        ),
        (
            {"HOROVOD_CYCLE_TIME": "5000", "HVDRUN_GLOO_TIMEOUT_SECONDS": "5"},
            "HOROVOD_CYCLE_TIME=5000 ms is not shorter than the collectives' timeout (5 s)",
        ),
        # (-x HOROVOD_LOG_LEVEL=bogus: every rank would warn of it and ignore it)
        ({"HOROVOD_LOG_LEVEL": "bogus"}, "HOROVOD_LOG_LEVEL must be one of TRACE, DEBUG, "),
    ],
)
def test_check_settings_names_the_variable_the_user_set(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        worker_env.check_settings(env)


def test_check_settings_takes_good_values_and_the_defaults() -> None:
    worker_env.check_settings({})
    worker_env.check_settings(
        {"HOROVOD_FUSION_THRESHOLD": "0", "HVDRUN_CYCLE_TIME": "0.5", "HOROVOD_AUTOTUNE": "1"}
    )
    worker_env.check_settings({"HOROVOD_AUTOTUNE": "2", "HOROVOD_STALL_CHECK_DISABLE": "-1"})
    # The winning spelling is the one checked: a bad HOROVOD_ value under a good HVDRUN_ one
    # never reaches a worker.
    worker_env.check_settings({"HVDRUN_CYCLE_TIME": "2", "HOROVOD_CYCLE_TIME": "x"})
    for level in ("warn", "Trace", "CRITICAL", ""):
        worker_env.check_settings({"HOROVOD_LOG_LEVEL": level})


def test_the_log_levels_checked_are_those_the_workers_take() -> None:
    from collectives.runtime import logs

    assert set(logs.LEVELS) == set(worker_env.LOG_LEVELS)
    assert worker_env.number(worker_env.FUSION_THRESHOLD, env={}) == 128 * 1024 * 1024


@pytest.mark.parametrize(
    ("raw", "value"),
    # (and any whole number as Horovod reads it, strtol(value) > 0)
    [("1", True), ("yes", True), ("off", False), ("0", False), ("2", True), ("-1", False)],
)
def test_flag(raw: str, value: bool) -> None:
    assert worker_env.flag("ELASTIC", {"HVDRUN_ELASTIC": raw}) is value


def test_flag_rejects_other_words() -> None:
    with pytest.raises(ValueError, match="HVDRUN_ELASTIC must be 0 or 1"):
        worker_env.flag("ELASTIC", {"HVDRUN_ELASTIC": "maybe"})


def test_integer() -> None:
    assert worker_env.integer(worker_env.GENERATION, 0, {}) == 0
    assert worker_env.integer(worker_env.GENERATION, 0, {"HVDRUN_GENERATION": "4"}) == 4
    with pytest.raises(ValueError, match="HVDRUN_GENERATION must be an integer"):
        worker_env.integer(worker_env.GENERATION, 0, {"HVDRUN_GENERATION": "x"})


def test_slot_env_names_the_place_in_both_vocabularies() -> None:
    slot = assign_slots([("a", 2), ("b", 2)], 4)[3]
    env = worker_env.slot_env(slot)
    assert env["HVDRUN_RANK"] == env["RANK"] == "3"
    assert env["HVDRUN_SIZE"] == env["WORLD_SIZE"] == "4"
    assert env["HVDRUN_LOCAL_RANK"] == env["LOCAL_RANK"] == "1"
    assert env["HVDRUN_LOCAL_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    assert (env["HVDRUN_CROSS_RANK"], env["HVDRUN_CROSS_SIZE"]) == ("1", "2")
    assert env["HVDRUN_HOSTNAME"] == "b"


def test_lightning_counts_each_host_as_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning's DDP makes a rank's global rank from its node rank and local rank: without
    # NODE_RANK every host's local rank 0 would be global rank 0.
    environments = pytest.importorskip("lightning.fabric.plugins.environments")
    for slot in assign_slots([("a", 2), ("b", 2)], 4):
        for name, value in worker_env.slot_env(slot).items():
            monkeypatch.setenv(name, value)
        node = environments.LightningEnvironment().node_rank()
        assert node * slot.local_size + slot.local_rank == slot.rank


def test_fresh_credentials_differ() -> None:
    assert worker_env.new_secret() != worker_env.new_secret()
    assert len(worker_env.new_secret()) >= 43  # 256 bits
    assert worker_env.new_job_id() != worker_env.new_job_id()


def test_slot_env_has_horovods_names_too() -> None:
    slot = assign_slots([("a", 2), ("b", 2)], 4)[3]
    env = worker_env.slot_env(slot)
    assert {k: v for k, v in env.items() if k.startswith("HOROVOD_")} == {
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_HOSTNAME": "b",
    }


def test_rounds_of_one_job_are_told_from_other_jobs() -> None:
    first, second = (worker_env.round_job_id("abc123", n) for n in (1, 2))
    assert worker_env.other_round(second, first) and worker_env.other_round(first, second)
    assert not worker_env.other_round(first, first)
    assert not worker_env.other_round(worker_env.round_job_id("zzz", 2), first)
    assert not worker_env.other_round("plainid", "plainid2")  # (hvdrun's ids have no round)
