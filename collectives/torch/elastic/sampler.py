"""``ElasticSampler``: a distributed sampler whose epoch survives a change of world size.

The sampler keeps the set of sample indices the job has processed in the current epoch.
After a reset it takes the epoch's remaining indices (in the epoch's shuffled order) and
splits them over the new number of ranks, so that no sample is lost or seen twice in the
epoch whatever the membership does. ``record_batch`` marks the batch of *every* rank as
processed (all ranks step in lockstep and the split is deterministic), so the samples of a
host that died with its work committed are not trained on again.

The epoch's order is Horovod's (``random.Random(seed + epoch)`` shuffles the indices), and
``state_dict()`` holds Horovod's ``processed_num`` beside the processed indices, so a
sampler state saved under Horovod loads here (its processed samples are the first
``processed_num`` of that order, as Horovod's split makes them) and the other way round.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import Sampler

from collectives import runtime

__all__ = ["ElasticSampler"]


class ElasticSampler(Sampler[int]):
    """Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)``."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        # Split for one rank because made before hvd.init(): split again for the job at its
        # first use (a DataLoader asks its length, then iterates), where Horovod's refuses.
        self._before_init = False
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self._shards: list[list[int]] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts an epoch: nothing processed yet, a new shuffle."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def _order(self) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:  # (Horovod's shuffle: the same order as under Horovod)
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    @property
    def processed_num(self) -> int:
        """How many samples of the epoch were processed (Horovod's attribute)."""
        return len(self.processed_indices)

    @processed_num.setter
    def processed_num(self, number: int) -> None:
        """Horovod's way to say the epoch's first ``number`` samples (in its order) are done."""
        self.processed_indices = set(self._order()[: int(number)])
        self.reset()

    def reset(self) -> None:
        """Re-splits the epoch's remaining samples over the current ranks."""
        if runtime.is_initialized():
            self.split(runtime.size(), runtime.rank())
        else:
            self.split(self.num_replicas, self.rank)
            self._before_init = True

    def _for_the_job(self) -> None:
        """Splits for the job a sampler that was split before ``hvd.init()``."""
        if self._before_init and runtime.is_initialized():
            self.reset()

    def split(self, num_replicas: int, rank: int) -> None:
        """Splits the epoch's remaining samples over ``num_replicas`` ranks (this is ``rank``)."""
        self.num_replicas, self.rank = num_replicas, rank
        self._before_init = False
        self.remaining_indices = [i for i in self._order() if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        # Padded (by repeating from the start) so that every rank gets num_samples; the
        # shards are built once here, since every step's record_batch() reads all of them.
        padded = list(self.remaining_indices)
        if padded and len(padded) < self.total_size:
            padded += (padded * math.ceil(self.total_size / len(padded)))[
                : self.total_size - len(padded)
            ]
        self._shards = [padded[r : self.total_size : num_replicas] for r in range(num_replicas)]

    def _shard(self, rank: int) -> list[int]:
        return self._shards[rank]

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's indices of batch ``batch_idx`` (counted from the last reset)."""
        return self._shard(self.rank)[batch_idx * batch_size : (batch_idx + 1) * batch_size]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Marks batch ``batch_idx`` (counted from the last reset) of every rank processed."""
        start, end = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for rank in range(self.num_replicas):
            self.processed_indices.update(self._shard(rank)[start:end])

    def record_indices(self, indices: list[int]) -> None:
        self.processed_indices.update(indices)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "processed_indices": sorted(self.processed_indices),
            "processed_num": self.processed_num,  # (what Horovod's sampler loads)
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state of :meth:`state_dict`, or of Horovod's sampler (``epoch`` and
        ``processed_num``: the first that many samples of the epoch's order)."""
        self.epoch = int(state_dict["epoch"])
        if "processed_indices" in state_dict:
            self.processed_indices = set(state_dict["processed_indices"])
            self.reset()
        else:
            self.processed_num = state_dict["processed_num"]

    def __iter__(self) -> Iterator[int]:
        self._for_the_job()
        return iter(self._shard(self.rank))

    def __len__(self) -> int:
        self._for_the_job()
        return self.num_samples
