"""An elastic training loop whose every step lowers one weight by exactly 1.

Each step allreduces a gradient of ones (the average is 1 on any number of ranks) and
applies it with SGD (lr 1), then commits. After n steps the weight must be exactly -n on
every rank whatever failed or changed on the way: a step lost or applied twice would show.
Prints one ``committed`` line per commit (rank, size, generation, wall time).
"""

from __future__ import annotations

import os
import signal
import time

import torch

import collectives.torch as hvd
from collectives import runtime
from collectives.torch import elastic

STEPS = int(os.environ.get("STEPS", "40"))
INTERVAL = float(os.environ.get("STEP_INTERVAL", "0.1"))
# FAIL_HOST=h FAIL_AT_STEP=n: the workers on host h ("*": every host) exit 1 after
# committing step n (with
# FAIL_MODE=hang: stop themselves with SIGSTOP instead; with FAIL_MODE=finish: exit 0; with
# FAIL_MODE=reset: raise HorovodInternalError, which hvd.elastic.run resets on).
FAIL_AT_STEP = int(os.environ.get("FAIL_AT_STEP", "0"))
FAIL_HOST = os.environ.get("FAIL_HOST")
# STOP_FILE=path: every rank stops after the first step that follows the file's creation
# (agreed by an allreduce), so a test can end the job once it has seen what it waits for.
STOP_FILE = os.environ.get("STOP_FILE")
# FINISH_AT_GENERATION=n: a worker that hears of generation n before a commit finishes
# (returns from training, exit 0) instead of joining it: the end of a job that coincides
# with a new generation.
FINISH_AT_GENERATION = int(os.environ.get("FINISH_AT_GENERATION", "0"))
# SLOW_HOST=h START_FILE=path: the workers on host h wait (up to 60 s) for the file to exist
# before hvd.init(), as a host slow to start does: the sync of the generation that added
# it is under way until then.
SLOW_HOST = os.environ.get("SLOW_HOST")
# LONG_STEP_HOST=h LONG_STEP_SECONDS=s: the workers on host h spend s seconds in their own
# code (no collective) after committing step FAIL_AT_STEP, as a long step does.
LONG_STEP_HOST = os.environ.get("LONG_STEP_HOST")

# DEVICE=cuda: the weight and its gradient live on this rank's GPU (tests/gpu).
DEVICE = os.environ.get("DEVICE", "cpu")

torch.set_num_threads(1)
if SLOW_HOST and os.environ.get("HVDRUN_HOSTNAME") == SLOW_HOST:
    give_up = time.monotonic() + 60
    while not os.path.exists(os.environ["START_FILE"]) and time.monotonic() < give_up:
        time.sleep(0.05)
hvd.init()
if DEVICE == "cuda":
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
model = torch.nn.Linear(1, 1, bias=False).to(DEVICE)
with torch.no_grad():
    model.weight.zero_()
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
# A scheduler that keeps lr at 1 and counts the steps (last_epoch): it must stay bound to
# this optimizer and agree with the step count through every restore and sync.
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
state = elastic.TorchState(model=model, optimizer=optimizer, scheduler=scheduler, step=0)
resets: list[int] = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


@elastic.run
def train(state: elastic.TorchState) -> None:
    while state.step < STEPS:
        optimizer.zero_grad()
        model.weight.grad = hvd.allreduce(torch.ones_like(model.weight), name="grad")
        optimizer.step()
        state.scheduler.step()
        state.step += 1
        time.sleep(INTERVAL)
        if FINISH_AT_GENERATION and runtime.newest_generation() >= FINISH_AT_GENERATION:
            print(f"finishing as generation {runtime.newest_generation()} comes", flush=True)
            return
        state.commit()
        print(
            f"committed step={state.step} rank={hvd.rank()} size={hvd.size()} "
            f"generation={runtime.generation()} time={time.time():.4f}",
            flush=True,
        )
        here = os.environ.get("HVDRUN_HOSTNAME")
        if state.step == FAIL_AT_STEP and here == LONG_STEP_HOST:
            print(f"a long step of its own after step {state.step}", flush=True)
            time.sleep(float(os.environ["LONG_STEP_SECONDS"]))
        if state.step == FAIL_AT_STEP and FAIL_HOST in ("*", here):
            if os.environ.get("FAIL_MODE") == "finish":
                print(f"finishing early after step {state.step}", flush=True)
                raise SystemExit(0)
            if os.environ.get("FAIL_MODE") == "reset":  # (as a script's own check may)
                raise hvd.HorovodInternalError(f"resetting on purpose after step {state.step}")
            if os.environ.get("FAIL_MODE") == "hang":
                print(f"hanging on purpose after step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            raise SystemExit(f"failing on purpose after step {state.step}")
        if STOP_FILE:
            seen = torch.tensor([float(os.path.exists(STOP_FILE))])
            if hvd.allreduce(seen, name="stop", op=hvd.Max).item():
                return


train(state)
print(
    f"final rank={hvd.rank()} size={hvd.size()} step={state.step} "
    f"weight={model.weight.item():g} resets={resets} scheduled={state.scheduler.last_epoch} "
    f"bound={state.scheduler is scheduler and scheduler.optimizer is optimizer} "
    # Horovod's placement variables follow the worker's current place, as in Horovod.
    f"HOROVOD_RANK={os.environ.get('HOROVOD_RANK')} HOROVOD_SIZE={os.environ.get('HOROVOD_SIZE')}",
    flush=True,
)
