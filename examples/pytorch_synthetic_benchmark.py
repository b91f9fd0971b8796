"""Synthetic-data training throughput, Horovod-style: images/sec per worker and in total.

    hvdrun -np 2 python examples/pytorch_synthetic_benchmark.py --model convnet --batch-size 32

The models use torch.nn only (no torchvision), so the benchmark runs wherever torch does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import timeit

import torch
import torch.nn.functional as F
from torch import nn

import collectives.torch as hvd


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def resnet(widths: tuple[int, ...], num_classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
        nn.BatchNorm2d(widths[0]),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    channels = widths[0]
    for index, width in enumerate(widths):
        stride = 1 if index == 0 else 2
        layers += [BasicBlock(channels, width, stride), BasicBlock(width, width, 1)]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def convnet(num_classes: int = 1000) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 5, 2, 2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, 1, 1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, 1, 1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(128 * 16, 512),
        nn.ReLU(),
        nn.Linear(512, num_classes),
    )


MODELS = {
    "resnet18": lambda: resnet((64, 128, 256, 512)),
    "resnet_small": lambda: resnet((16, 32, 64, 128)),
    "convnet": convnet,
}


def choose_device(no_cuda: bool) -> torch.device:
    """This rank's GPU, one per local rank. With more local ranks than GPUs, NCCL cannot run
    the job: the ranks share the GPUs when hvdrun runs CUDA tensors through Gloo
    (--cuda-backend gloo), and train on the CPU otherwise."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not no_cuda else 0
    if gpus == 0:
        return torch.device("cpu")
    if hvd.local_size() <= gpus:
        return torch.device("cuda", hvd.local_rank())
    if os.environ.get("HVDRUN_CUDA_BACKEND", "").lower() == "gloo":
        return torch.device("cuda", hvd.local_rank() % gpus)
    if hvd.rank() == 0:
        print(
            f"{hvd.local_size()} ranks per host but {gpus} GPU(s): training on the CPU "
            "(hvdrun --cuda-backend gloo lets the ranks share the GPUs)",
            flush=True,
        )
    return torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="convnet")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--use-adasum", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--no-cuda", action="store_true")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(args.threads)
    device = choose_device(args.no_cuda)
    torch.manual_seed(1234)

    model = MODELS[args.model]().to(device)
    # Averaged gradients allow a learning rate that grows with the job; Adasum needs none.
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}, batch size: {args.batch_size} per worker, workers: {hvd.size()}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    rates = []
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{iteration}: {rate:.1f} img/sec per worker")
        rates.append(rate)
    mean = statistics.mean(rates)
    spread = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
    log(f"Img/sec per worker: {mean:.1f} +-{spread:.1f}")
    total, total_spread = hvd.size() * mean, hvd.size() * spread
    log(f"Total img/sec on {hvd.size()} worker(s): {total:.1f} +-{total_spread:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
