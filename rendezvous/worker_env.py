"""The environment contract between a launcher and its workers: names, parsing, defaults.

Everything hvdrun tells a worker travels in environment variables, and this module is the
one place that spells them. The CLI and the launcher write them, the agent passes them on,
the worker runtime (``collectives.torch``) reads them: all import this module, which imports
neither torch nor gRPC, so it costs the CLI nothing.

Two kinds of variables:

* **Placement and connection**, set by the launcher for each worker: where it sits in the
  job (``HVDRUN_RANK`` ... ``HVDRUN_HOSTNAME``, Horovod's ``HOROVOD_RANK`` ...
  ``HOROVOD_HOSTNAME`` and torch's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
  ``LOCAL_WORLD_SIZE`` for scripts that read those), how it reaches its job
  (``HVDRUN_RENDEZVOUS_ADDR``, ``HVDRUN_JOB_ID``, ``HVDRUN_SECRET``, and
  ``HVDRUN_RENDEZVOUS_CERT`` where the rendezvous speaks TLS) and, in elastic jobs,
  its membership generation. The rendezvous server's answer to registration is what counts;
  the placement variables let a script pick its GPU before ``hvd.init()``.
* **Settings**, named without a prefix here (``FUSION_THRESHOLD``): a worker reads each as
  ``HVDRUN_<name>`` or, Horovod's spelling, ``HOROVOD_<name>``; the ``HVDRUN_`` spelling wins
  and an empty value counts as unset. :func:`setting`, :func:`number` and :func:`flag` parse
  them, with errors that name the variable that was set; :data:`NUMBERS` holds the numeric
  ones' defaults and bounds, which :func:`check_settings` applies before a job starts.
"""

from __future__ import annotations

import math
import os
import secrets
import stat
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from rendezvous.slots import SlotInfo

__all__ = [
    "CUDA_BACKEND",
    "ELASTIC",
    "ELASTIC_TIMEOUT",
    "ENDED_BY_KEY_PREFIX",
    "FLAGS",
    "FUNCTION_KEY",
    "GENERATION",
    "GLOO_TIMEOUT_SECONDS",
    "HOSTNAME",
    "INSIGHT_KEY_PREFIX",
    "JOB_ID",
    "LAUNCHER_SET",
    "LOCAL_RANK",
    "NUMBERS",
    "RANK",
    "RENDEZVOUS_ADDR",
    "RENDEZVOUS_CERT",
    "RENDEZVOUS_RELAY",
    "RENDEZVOUS_RELAY_ADDR",
    "RESULT_KEY_PREFIX",
    "SECRET",
    "STALLED_BY_KEY_PREFIX",
    "STATE_KEY_PREFIX",
    "WORKER",
    "Number",
    "check_settings",
    "choice",
    "connection_env",
    "device_or_pipe",
    "flag",
    "horovod_placement_env",
    "integer",
    "new_job_id",
    "new_secret",
    "number",
    "other_round",
    "round_job_id",
    "setting",
    "setting_names",
    "slot_env",
    "spelled",
    "timeline_file",
    "variable",
]

PREFIX = "HVDRUN_"
HOROVOD_PREFIX = "HOROVOD_"

# ---- placement: one value per worker ---------------------------------------------------
RANK = "HVDRUN_RANK"
SIZE = "HVDRUN_SIZE"
LOCAL_RANK = "HVDRUN_LOCAL_RANK"
LOCAL_SIZE = "HVDRUN_LOCAL_SIZE"
CROSS_RANK = "HVDRUN_CROSS_RANK"
CROSS_SIZE = "HVDRUN_CROSS_SIZE"
HOSTNAME = "HVDRUN_HOSTNAME"
#: Horovod's names for the same facts (horovodrun sets them; scripts read them before
#: ``hvd.init()``, e.g. ``HOROVOD_LOCAL_RANK`` to pick a GPU).
HOROVOD_RANK = "HOROVOD_RANK"
HOROVOD_SIZE = "HOROVOD_SIZE"
HOROVOD_LOCAL_RANK = "HOROVOD_LOCAL_RANK"
HOROVOD_LOCAL_SIZE = "HOROVOD_LOCAL_SIZE"
HOROVOD_CROSS_RANK = "HOROVOD_CROSS_RANK"
HOROVOD_CROSS_SIZE = "HOROVOD_CROSS_SIZE"
HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"
#: torch.distributed's names for the same facts (torchrun sets them too).
TORCH_RANK = "RANK"
TORCH_WORLD_SIZE = "WORLD_SIZE"
TORCH_LOCAL_RANK = "LOCAL_RANK"
TORCH_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
#: The host's index among the job's hosts, for Lightning's DDP (its node rank; without it,
#: every host's local rank 0 would count itself global rank 0): the cross rank, which is the
#: host's index where every host runs as many ranks, as Lightning's nodes must.
NODE_RANK = "NODE_RANK"
#: Where init_process_group(init_method="env://") meets (fixed jobs; picked on rank 0's host).
TORCH_MASTER_ADDR = "MASTER_ADDR"
TORCH_MASTER_PORT = "MASTER_PORT"

# ---- connection: the same for every worker of a job -------------------------------------
RENDEZVOUS_ADDR = "HVDRUN_RENDEZVOUS_ADDR"
JOB_ID = "HVDRUN_JOB_ID"
SECRET = "HVDRUN_SECRET"
#: The job's TLS certificate (PEM) where the rendezvous speaks TLS (multi-host jobs); public,
#: but it travels with the secret so that a worker trusts exactly its own job's server.
RENDEZVOUS_CERT = "HVDRUN_RENDEZVOUS_CERT"
#: Multi-host jobs: the host's rendezvous relay (``unix:...``), which workers dial instead of
#: ``HVDRUN_RENDEZVOUS_ADDR`` (that stays the server's address).
RENDEZVOUS_RELAY_ADDR = "HVDRUN_RENDEZVOUS_RELAY_ADDR"
#: Elastic jobs: the membership generation a worker was started for.
GENERATION = "HVDRUN_GENERATION"
#: Elastic jobs: the worker's number, unique in the job (its output prefix ``[N]``); its
#: reports to the launcher are keyed by it.
WORKER = "HVDRUN_WORKER"
#: Elastic jobs: a worker that holds the job's training state says so in the rendezvous
#: store, under this prefix and its number, with the generation it last synced the state
#: in (see ``collectives.runtime.state_synced``); the launcher never starts a generation
#: from workers that hold none.
STATE_KEY_PREFIX = "hvdrun/state/"
#: Elastic jobs: while some workers wait for the others to rejoin after a failure, hvdrun
#: calls the roll on the watch streams, and every worker answers from its watch thread,
#: under this prefix and its number, with the roll call's number: one that answers is alive
#: (a long step of its own), one that does not is stopped or hung.
PRESENT_KEY_PREFIX = "hvdrun/present/"
#: Every worker publishes its arrival figures (JSON, see :mod:`rendezvous.insight`) in the
#: rendezvous store under this prefix and its number (its rank in fixed jobs), every few
#: seconds and at shutdown; the launcher reads them for its report.
INSIGHT_KEY_PREFIX = "hvdrun/insight/"
#: A worker whose collectives ended because another rank left (shut down, or ended its
#: script) writes that rank under this prefix and its own rank at shutdown, before it exits:
#: when both then fail, hvdrun names the one that left as the first failure, whichever exit
#: it heard of first.
ENDED_BY_KEY_PREFIX = "hvdrun/ended-by/"
#: A worker whose collectives the stall inspector stopped, because another rank never
#: submitted an op it waited for, writes that rank and the op (``"<rank>\n<op>"``) under
#: this prefix and its own rank, before it exits: hvdrun names the rank that held the job
#: up as the first failure, not the rank whose error it heard of first.
STALLED_BY_KEY_PREFIX = "hvdrun/stalled-by/"
#: ``hvdrun.run(fn, ...)``: the launcher puts ``(fn, args, kwargs)``, pickled, in the store
#: under this key before any worker starts (in pieces, :mod:`rendezvous.pieces`); each
#: worker (``python -m collectives.run_task``) reads it, calls ``fn`` and puts what it
#: returned under ``RESULT_KEY_PREFIX`` and its rank, which the launcher reads at the end.
FUNCTION_KEY = "hvdrun/run/function"
RESULT_KEY_PREFIX = "hvdrun/run/result/"

# ---- settings: read as HVDRUN_<name> or HOROVOD_<name> ---------------------------------
FUSION_THRESHOLD = "FUSION_THRESHOLD"
CYCLE_TIME = "CYCLE_TIME"
TIMELINE = "TIMELINE"
TIMELINE_MARK_CYCLES = "TIMELINE_MARK_CYCLES"
#: Every rank writes its own timeline (FILE.<rank>.json), not rank 0 alone.
TIMELINE_ALL_RANKS = "TIMELINE_ALL_RANKS"
#: Jobs of other launchers: rank 0 writes the job's report (JSON) here at shutdown.
REPORT_FILE = "REPORT_FILE"
STALL_CHECK_DISABLE = "STALL_CHECK_DISABLE"
STALL_CHECK_TIME_SECONDS = "STALL_CHECK_TIME_SECONDS"
STALL_SHUTDOWN_TIME_SECONDS = "STALL_SHUTDOWN_TIME_SECONDS"
#: The engine's response cache and autotuner (Horovod's names).
CACHE_CAPACITY = "CACHE_CAPACITY"
AUTOTUNE = "AUTOTUNE"
AUTOTUNE_LOG = "AUTOTUNE_LOG"
AUTOTUNE_WARMUP_SAMPLES = "AUTOTUNE_WARMUP_SAMPLES"
AUTOTUNE_STEPS_PER_SAMPLE = "AUTOTUNE_STEPS_PER_SAMPLE"
AUTOTUNE_BAYES_OPT_MAX_SAMPLES = "AUTOTUNE_BAYES_OPT_MAX_SAMPLES"
AUTOTUNE_GAUSSIAN_PROCESS_NOISE = "AUTOTUNE_GAUSSIAN_PROCESS_NOISE"
#: How long a collective (and a negotiation round) waits for a peer.
GLOO_TIMEOUT_SECONDS = "GLOO_TIMEOUT_SECONDS"
#: Which backend carries CUDA tensors: ``nccl`` (the default where NCCL and a GPU exist) or
#: ``gloo`` (through host memory: several ranks may then share one GPU; ``hvdrun
#: --cuda-backend``).
CUDA_BACKEND = "CUDA_BACKEND"
CUDA_BACKENDS = ("nccl", "gloo")
#: How long the rendezvous heartbeat may stay silent (and the server not answer) before
#: the job counts as lost (``hvdrun --heartbeat-timeout``): well above the scheduling
#: hiccups of a loaded machine; a closed connection counts at once.
RENDEZVOUS_LOST_AFTER_SECONDS = "RENDEZVOUS_LOST_AFTER_SECONDS"
#: Elastic jobs: "1" marks one; how long a worker waits for the next generation.
ELASTIC = "ELASTIC"
#: 0 turns the per-host rendezvous relay off (workers then dial the server themselves).
RENDEZVOUS_RELAY = "RENDEZVOUS_RELAY"
ELASTIC_TIMEOUT = "ELASTIC_TIMEOUT"

_TRUE = frozenset(("1", "true", "yes", "on", "y", "t"))
_FALSE = frozenset(("0", "false", "no", "off", "n", "f", ""))


def variable(name: str) -> str:
    """The variable a launcher sets for a setting: ``HVDRUN_<name>``."""
    return PREFIX + name


def setting_names(name: str) -> tuple[str, str]:
    """The two spellings of a setting, the one that wins first."""
    return PREFIX + name, HOROVOD_PREFIX + name


def setting(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A setting's value (``HVDRUN_<name>``, else ``HOROVOD_<name>``); None when unset."""
    found = spelled(name, env)
    return None if found is None else found[1]


def spelled(name: str, env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The variable that sets ``name`` (the spelling that wins) and its value; None when
    unset."""
    source = os.environ if env is None else env
    for variable in setting_names(name):
        value = source.get(variable)
        if value:
            return variable, value
    return None


@dataclass(frozen=True)
class Number:
    """A numeric setting's default, and the least value it takes (``strict``: it must be
    greater), and the largest, where it has one."""

    default: float
    minimum: float = 0.0
    strict: bool = False
    maximum: float = math.inf


#: The longest time a setting may give, in seconds (about 31 years: "never" in practice);
#: beyond it (1e10 s, as "never" is often written) Gloo's millisecond timeouts overflow.
LONGEST_SECONDS = 1e9

#: The fusion threshold of reductions of CUDA tensors where no fusion threshold was set
#: (see collectives/engine/config.py); a threshold that was set applies to them too.
CUDA_FUSION_THRESHOLD_DEFAULT = 4 * 1024 * 1024

#: The numeric settings of the engine and the runtime, read by the workers with these
#: defaults and bounds, and checked by hvdrun before any process starts. Defaults are
#: Horovod's.
NUMBERS: dict[str, Number] = {
    FUSION_THRESHOLD: Number(128 * 1024 * 1024),
    CYCLE_TIME: Number(1.0, maximum=LONGEST_SECONDS),  # (ms; below the timeout: see check)
    STALL_CHECK_TIME_SECONDS: Number(60.0, maximum=LONGEST_SECONDS),
    STALL_SHUTDOWN_TIME_SECONDS: Number(0.0, maximum=LONGEST_SECONDS),
    GLOO_TIMEOUT_SECONDS: Number(30.0, strict=True, maximum=LONGEST_SECONDS),
    CACHE_CAPACITY: Number(1024),
    AUTOTUNE_WARMUP_SAMPLES: Number(3),
    AUTOTUNE_STEPS_PER_SAMPLE: Number(10, minimum=1),
    AUTOTUNE_BAYES_OPT_MAX_SAMPLES: Number(20, minimum=1),
    AUTOTUNE_GAUSSIAN_PROCESS_NOISE: Number(0.8, maximum=1.0),
    RENDEZVOUS_LOST_AFTER_SECONDS: Number(30.0, strict=True, maximum=LONGEST_SECONDS),
    ELASTIC_TIMEOUT: Number(600.0, strict=True, maximum=LONGEST_SECONDS),
}
#: The 0/1 settings hvdrun checks alike.
FLAGS = (TIMELINE_MARK_CYCLES, TIMELINE_ALL_RANKS, STALL_CHECK_DISABLE, AUTOTUNE)


def number(
    name: str,
    default: float | None = None,
    *,
    minimum: float | None = None,
    strict: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> float:
    """A numeric setting (default and bounds: :data:`NUMBERS`', unless given); ValueError
    naming the variable that set it when malformed or out of bounds."""
    known = NUMBERS.get(name)
    maximum = math.inf
    if known is not None:
        maximum = known.maximum
        default = known.default if default is None else default
        minimum = known.minimum if minimum is None else minimum
        strict = known.strict if strict is None else strict
    found = spelled(name, env)
    if found is None:
        assert default is not None, name
        return default
    spelling, raw = found
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{spelling} must be a number, got {raw!r}")
    low = 0.0 if minimum is None else minimum
    if value < low or (strict and value <= low):
        bound = f"greater than {low:g}" if strict else f"at least {low:g}"
        raise ValueError(f"{spelling} must be {bound}, got {raw!r}")
    if value > maximum:
        raise ValueError(f"{spelling} must be at most {maximum:g}, got {raw!r}")
    return value


def flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """A 0/1 setting (also true/false, yes/no, on/off); any other whole number counts as
    Horovod counts it (``strtol(value) > 0``: ``2`` is on, ``-1`` off); ValueError naming
    it when none of these."""
    found = spelled(name, env)
    return False if found is None else switch(found[1], found[0])


def switch(raw: str, spelling: str = "the value") -> bool:
    """A switch's value as :func:`flag` reads it; ValueError naming ``spelling``."""
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    try:
        return int(lowered) > 0
    except ValueError:
        raise ValueError(f"{spelling} must be 0 or 1, got {raw!r}") from None


def choice(name: str, choices: tuple[str, ...], env: Mapping[str, str] | None = None) -> str | None:
    """A setting that must be one of ``choices`` (case-insensitive); None when unset;
    ValueError naming the variable that set it and the choices otherwise."""
    found = spelled(name, env)
    if found is None:
        return None
    spelling, raw = found
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{spelling} must be one of {', '.join(choices)}; got {raw!r}")
    return value


#: Elastic workers wait this much longer than their launcher for the next generation, so
#: that the launcher's clear message, not a worker's timeout, ends a job out of hosts.
ELASTIC_WORKER_SLACK = 30.0


def elastic_env(
    env: Mapping[str, str | None], elastic_timeout: float, gloo_timeout: float
) -> dict[str, str]:
    """What every worker of an elastic job gets on top of the job's environment ``env``:
    the elastic switch, its wait for a generation, and (unless ``env`` sets one) the Gloo
    timeout that detects a hung peer."""
    extra = {
        variable(ELASTIC): "1",
        variable(ELASTIC_TIMEOUT): f"{elastic_timeout + ELASTIC_WORKER_SLACK:g}",
    }
    if not any(env.get(name) is not None for name in setting_names(GLOO_TIMEOUT_SECONDS)):
        extra[variable(GLOO_TIMEOUT_SECONDS)] = f"{gloo_timeout:g}"
    return extra


#: Horovod's log level variable, and the levels the workers take (any case).
LOG_LEVEL = "HOROVOD_LOG_LEVEL"
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "WARN", "ERROR", "FATAL", "CRITICAL")


def check_settings(env: Mapping[str, str], *, elastic: bool = True) -> None:
    """Parses every setting of :data:`NUMBERS`, :data:`FLAGS`, the CUDA backend and the
    log level in ``env`` as the workers will: ValueError naming the first variable they
    would refuse (or, for the log level, warn of on every rank and ignore). A fixed-size
    job's workers never read :data:`ELASTIC_TIMEOUT` (``elastic`` False): any value may
    stand there, as horovodrun lets it."""
    for name in NUMBERS:
        if elastic or name != ELASTIC_TIMEOUT:
            number(name, env=env)
    for name in FLAGS:
        flag(name, env)
    cycle, timeout = number(CYCLE_TIME, env=env), number(GLOO_TIMEOUT_SECONDS, env=env)
    if cycle / 1000 >= timeout:
        cycle_name = (spelled(CYCLE_TIME, env) or (variable(CYCLE_TIME), ""))[0]
        raise ValueError(
            f"{cycle_name}={cycle:g} ms is not shorter than the collectives' timeout "
            f"({timeout:g} s): ranks that wait a cycle for each other would give each other "
            "up as dead"
        )
    choice(CUDA_BACKEND, CUDA_BACKENDS, env)
    level = env.get(LOG_LEVEL, "").strip()
    if level and level.upper() not in LOG_LEVELS:
        raise ValueError(f"{LOG_LEVEL} must be one of {', '.join(LOG_LEVELS)}; got {level!r}")


def integer(variable: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """A plain integer variable (spelled in full); ValueError naming it when malformed."""
    raw = (os.environ if env is None else env).get(variable)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{variable} must be an integer, got {raw!r}") from None


def slot_env(slot: SlotInfo) -> dict[str, str]:
    """The placement variables of the worker that runs ``slot``: hvdrun's, Horovod's
    (:func:`horovod_placement_env`) and torch's names."""
    return {
        RANK: str(slot.rank),
        SIZE: str(slot.size),
        LOCAL_RANK: str(slot.local_rank),
        LOCAL_SIZE: str(slot.local_size),
        CROSS_RANK: str(slot.cross_rank),
        CROSS_SIZE: str(slot.cross_size),
        HOSTNAME: slot.hostname,
        **horovod_placement_env(
            slot.rank,
            slot.size,
            slot.local_rank,
            slot.local_size,
            slot.cross_rank,
            slot.cross_size,
            slot.hostname,
        ),
        TORCH_RANK: str(slot.rank),
        TORCH_WORLD_SIZE: str(slot.size),
        TORCH_LOCAL_RANK: str(slot.local_rank),
        TORCH_LOCAL_WORLD_SIZE: str(slot.local_size),
        NODE_RANK: str(slot.cross_rank),
    }


def horovod_placement_env(
    rank: int,
    size: int,
    local_rank: int,
    local_size: int,
    cross_rank: int,
    cross_size: int,
    hostname: str,
) -> dict[str, str]:
    """Horovod's placement variables (``HOROVOD_RANK`` ... ``HOROVOD_HOSTNAME``), as
    horovodrun sets them. An elastic worker's runtime sets them again to each new
    assignment, as Horovod's does on a reset; the ``HVDRUN_*`` ones keep naming the slot
    the worker was started for (the runtime registers with them)."""
    return {
        HOROVOD_RANK: str(rank),
        HOROVOD_SIZE: str(size),
        HOROVOD_LOCAL_RANK: str(local_rank),
        HOROVOD_LOCAL_SIZE: str(local_size),
        HOROVOD_CROSS_RANK: str(cross_rank),
        HOROVOD_CROSS_SIZE: str(cross_size),
        HOROVOD_HOSTNAME: hostname,
    }


def timeline_file(path: str, rank: int, all_ranks: bool = False) -> str | None:
    """The file rank ``rank`` writes its timeline to, if any: rank 0 writes ``path``, as in
    Horovod. A ``{rank}`` in ``path``, or ``all_ranks`` (``HVDRUN_TIMELINE_ALL_RANKS``),
    gives every rank its own: ``{rank}`` replaced, else the rank before the extension
    (``trace.json`` -> ``trace.3.json``)."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if all_ranks:
        root, ext = os.path.splitext(path)
        return f"{root}.{rank}{ext}"
    return path if rank == 0 else None


def device_or_pipe(path: str) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a directory (a device such
    as ``/dev/null``, a pipe, a socket): a timeline there takes rank 0's events, but every
    rank's own file named after it (:func:`timeline_file`) would be a new regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def master_env(address: str, port: int) -> dict[str, str]:
    """Where plain ``torch.distributed`` scripts meet with ``init_method="env://"``."""
    return {TORCH_MASTER_ADDR: address, TORCH_MASTER_PORT: str(port)}


def connection_env(
    rendezvous_addr: str, job_id: str, secret: str, cert_pem: str = ""
) -> dict[str, str]:
    """How every worker of a job reaches its rendezvous (``cert_pem``: its TLS certificate;
    empty where it speaks no TLS, which overrides one inherited from an enclosing job)."""
    return {
        RENDEZVOUS_ADDR: rendezvous_addr,
        JOB_ID: job_id,
        SECRET: secret,
        RENDEZVOUS_CERT: cert_pem,
    }


#: The variables a launcher (hvdrun, Spark's driver, Ray's executor) sets on every worker
#: itself: the job's rendezvous and the worker's place in it, whatever the environment says.
LAUNCHER_SET = frozenset(
    [*connection_env("x", "x", "x", "x"), *slot_env(SlotInfo("x", 0, 1, 0, 1, 0, 1))]
)


def new_secret() -> str:
    """A fresh job secret: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def new_job_id() -> str:
    """A fresh job id (not secret: it names the job in the rendezvous's metadata)."""
    return uuid.uuid4().hex[:16]


def round_job_id(job_id: str, round_: int) -> str:
    """The id of a job's ``round_``-th ``hvd.init()`` under another launcher: each round
    meets at a rendezvous of its own (rank 0 serves a round's until the others left it)."""
    return f"{job_id}.{round_}"


def other_round(asked: str, serving: str) -> bool:
    """Whether job ids ``asked`` and ``serving`` are two rounds of one job
    (:func:`round_job_id`): a rank calling on the server of the round before, which will go."""
    job, dot, _ = asked.rpartition(".")
    return bool(dot) and serving.rpartition(".")[0] == job and serving != asked
