"""Lightning trains with its own DDP on 2 CPU processes; hvd's ops carry the metrics.

``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` starts rank 1 by running this
script again, and makes torch.distributed's default group in both processes before the
model's hooks run. ``hvd.init()`` in ``on_fit_start`` joins that job. Every epoch each rank
averages its own loss with ``hvd.allreduce``, which must equal Lightning's own reduction
over its group; ``hvd.allgather_object`` and ``hvd.broadcast_object`` carry the per-rank
losses and rank 0's summary. After ``fit`` the ranks' weights must be identical (Lightning's
DDP kept them in step) and the group must outlive ``hvd.shutdown()``.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks, say

import collectives.torch as hvd

try:
    import lightning as L
except ImportError:  # the standalone package
    import pytorch_lightning as L  # type: ignore[no-redef]


class Regression(L.LightningModule):
    def __init__(self, checks: Checks) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.checks = checks
        self.losses: list[torch.Tensor] = []

    def on_fit_start(self) -> None:
        hvd.init()
        say(
            f"ID rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/"
            f"{hvd.local_size()} cross={hvd.cross_rank()}/{hvd.cross_size()} "
            f"host={socket.gethostname()}"
        )
        trainer = self.trainer
        self.checks.expect(
            "hvd places this process as Lightning does",
            (hvd.rank(), hvd.size(), hvd.local_rank())
            == (trainer.global_rank, trainer.world_size, trainer.local_rank),
            (hvd.rank(), hvd.size(), trainer.global_rank, trainer.world_size),
        )

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        epoch = self.current_epoch
        local = torch.stack(self.losses).mean()
        self.losses.clear()
        average = hvd.allreduce(local, op=hvd.Average, name=f"loss.{epoch}")
        lightning_average = self.trainer.strategy.reduce(local.clone(), reduce_op="mean")
        self.checks.close(f"epoch {epoch}: hvd.allreduce", average, lightning_average, 1e-6)
        every = hvd.allgather_object(local.item())
        self.checks.expect(
            f"epoch {epoch}: allgather_object", every[hvd.rank()] == local.item(), every
        )
        self.checks.expect(f"epoch {epoch}: each rank its own data", len(set(every)) == 2, every)
        self.checks.close(
            f"epoch {epoch}: mean of the gathered losses",
            torch.tensor(sum(every) / len(every)),
            average,
            1e-6,
        )
        summary = hvd.broadcast_object({"epoch": epoch, "from": hvd.rank(), "losses": every})
        self.checks.expect(
            f"epoch {epoch}: broadcast_object",
            summary == {"epoch": epoch, "from": 0, "losses": every},
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
        64, 1, generator=generator
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    checks = Checks()
    L.seed_everything(1)
    model = Regression(checks)
    root = tempfile.TemporaryDirectory(prefix="hvd-lightning-")  # (removed at exit)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root.name,
    )
    trainer.fit(model, loader)
    rank = hvd.rank()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(weights.unsqueeze(0), name="weights")
    checks.expect(
        "Lightning's DDP kept the weights identical",
        all(torch.equal(gathered[0], row) for row in gathered),
        gathered,
    )
    hvd.shutdown()
    checks.expect("Lightning's group outlives hvd.shutdown()", dist.is_initialized())
    checks.finish(rank)


if __name__ == "__main__":
    main()
