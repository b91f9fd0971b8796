"""An elastic Keras ``fit`` whose every step lowers one weight by exactly 1.

The model is one weight ``w`` (Dense(1), no bias, starting at 0) on inputs of ones, the loss
is the mean of its output: every rank's gradient is 1, so is their average, and SGD with
learning rate 1 lowers ``w`` by exactly 1 per step. The state is committed at the end of each
epoch; a failure mid-epoch goes back to the last commit and does that epoch again. After
EPOCHS epochs of STEPS steps the weight must be exactly -EPOCHS * STEPS on every rank, whatever
failed on the way. Prints one ``committed`` line per epoch (epoch, rank, size, generation).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import collectives.keras as hvd
from collectives import runtime

if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    import tf_keras as keras
else:
    import keras  # type: ignore[no-redef]

EPOCHS = int(os.environ.get("EPOCHS", "6"))
STEPS = int(os.environ.get("STEPS", "10"))
INTERVAL = float(os.environ.get("STEP_INTERVAL", "0.05"))

hvd.init()
model = keras.Sequential(
    [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
)
model.compile(
    hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)),
    loss=lambda y_true, y_pred: keras.ops.mean(y_pred),
)
x = np.ones((STEPS * 2, 1), np.float32)
y = np.zeros((STEPS * 2, 1), np.float32)
resets: list[str] = []


class State(hvd.elastic.TensorFlowKerasState):  # (Horovod's name for it, and its hook)
    def reset(self) -> None:
        resets.append(f"reset:{hvd.size()}")


state = State(model, epoch=0, batch=0)
state.register_reset_callbacks([lambda: resets.append(f"callback:{hvd.size()}")])


class Report(keras.callbacks.Callback):  # type: ignore[misc]
    def on_batch_end(self, batch: int, logs: object = None) -> None:
        time.sleep(INTERVAL)

    def on_epoch_end(self, epoch: int, logs: object = None) -> None:
        weight = float(np.asarray(self.model.get_weights()[0]).ravel()[0])
        print(
            f"committed epoch={state.epoch} rank={hvd.rank()} size={hvd.size()} "
            f"generation={runtime.generation()} weight={weight:g}",
            flush=True,
        )


# The epoch's number is updated before the commit at the epoch's end, so that a commit
# holds the weights and the epoch count of the same moment.
callbacks = [
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.CommitStateCallback(state, batches_per_commit=10**9),
    Report(),
]


@hvd.elastic.run
def train(state: hvd.elastic.KerasState) -> None:
    model.fit(
        x,
        y,
        batch_size=2,
        shuffle=False,
        epochs=EPOCHS - state.epoch,
        callbacks=callbacks,
        verbose=0,
    )


train(state)
weight = float(np.asarray(model.get_weights()[0]).ravel()[0])
print(
    f"final rank={hvd.rank()} size={hvd.size()} epoch={state.epoch} weight={weight:g} "
    f"resets={','.join(resets) or '-'}",
    flush=True,
)
