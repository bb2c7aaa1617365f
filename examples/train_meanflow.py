"""Train a one-step MeanFlow generator on several processes, ddp(params) inside torch.func.jvp.

MeanFlow (Geng et al., 2025) learns the *average* velocity ``u(z, r, t)`` of
the flow from noise to data between times ``r`` and ``t``, so one network
evaluation maps noise to a sample. Its training target needs the total time
derivative of ``u`` along the flow, ``d/dt u = v . du/dz + du/dt``, which is
one forward-mode product: ``torch.func.jvp(u, (z, r, t), (v, 0, 1))``. The
loss on ``u`` is then back-propagated as usual.

torch's DistributedDataParallel cannot sit inside that ``jvp``; fdp's can:
``ddp(params)`` is called inside the function ``jvp`` transforms, and the
gradients ``.backward()`` leaves on the parameters are the average over ranks,
reduced bucket by bucket while the backward runs. The data is scikit-learn's
two moons in 2-D; the script prints the MMD between one-step samples and
held-out data (next to the MMD of the noise and of a second data sample),
checks it against ``--max-mmd``, checks every rank holds the same parameters
and, with ``--plot``, draws the samples.

    torchrun --standalone --nproc_per_node=2 examples/train_meanflow.py --plot
    torchrun --standalone --nproc_per_node=2 examples/train_meanflow.py --compile
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import common
import torch
import torch.distributed as dist
from sklearn.datasets import make_moons

import fdp

Params = list[dict[str, torch.Tensor]]
Velocity = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def init_params(
    hidden: int, *, generator: torch.Generator, device: torch.device | str = "cpu"
) -> Params:
    """A 3-hidden-layer MLP on ``[z, t, t - r]``, He-initialised, on ``device``."""
    sizes = [4, hidden, hidden, hidden, 2]
    layers = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        w = torch.randn(fan_in, fan_out, generator=generator) * (2.0 / fan_in) ** 0.5
        b = torch.zeros(fan_out)
        layers.append({"w": w.to(device).requires_grad_(), "b": b.to(device).requires_grad_()})
    return layers


def average_velocity(
    params: Params, z: torch.Tensor, r: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """The model ``u(z, r, t)``: pure, all state is in ``params``."""
    x = torch.cat([z, t[:, None], (t - r)[:, None]], dim=1)
    *hidden, last = params
    for layer in hidden:
        x = torch.nn.functional.silu(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def sample_times(
    n: int, *, equal_fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r <= t``, uniform on [0, 1]; ``r = t`` for ``equal_fraction`` of them."""
    a, b = torch.rand(2, n, generator=generator)
    r, t = torch.minimum(a, b), torch.maximum(a, b)
    same = torch.rand(n, generator=generator) < equal_fraction
    return torch.where(same, t, r), t


def meanflow_loss(
    velocity: Velocity, x: torch.Tensor, noise: torch.Tensor, r: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """MeanFlow's loss on data ``x`` (adaptive weighting with power 1)."""
    z = (1 - t[:, None]) * x + t[:, None] * noise
    v = noise - x  # the flow's instantaneous velocity at z
    tangents = (v, torch.zeros_like(r), torch.ones_like(t))
    u, dudt = torch.func.jvp(velocity, (z, r, t), tangents)  # type: ignore[misc]
    target = (v - (t - r)[:, None] * dudt).detach()
    error = (u - target).pow(2).sum(1)
    # MeanFlow's adaptive weighting (power 1): each sample's error counts about once.
    loss: torch.Tensor = (error / (error.detach() + 1e-3)).mean()
    return loss


def one_step(params: Params, noise: torch.Tensor) -> torch.Tensor:
    """Samples in one network evaluation: ``x = e - u(e, 0, 1)``."""
    with torch.no_grad():
        zeros, ones = torch.zeros(len(noise)), torch.ones(len(noise))
        return noise - average_velocity(params, noise, zeros, ones)


def mmd(a: torch.Tensor, b: torch.Tensor) -> float:
    """Unbiased squared MMD with a sum of RBF kernels (bandwidths 0.1, 0.3, 1)."""
    xs = torch.cat([a, b]).double()
    d2 = torch.cdist(xs, xs).pow(2)
    k = torch.stack([torch.exp(-d2 / (2 * s**2)) for s in (0.1, 0.3, 1.0)]).sum(0)
    n, m = len(a), len(b)
    kaa, kbb, kab = k[:n, :n], k[n:, n:], k[:n, n:]
    off = (kaa.sum() - kaa.diagonal().sum()) / (n * (n - 1))
    off_b = (kbb.sum() - kbb.diagonal().sum()) / (m * (m - 1))
    return float(off + off_b - 2 * kab.mean())


def load_data(n: int, seed: int) -> torch.Tensor:
    """Two moons (scikit-learn), standardised."""
    points, _ = make_moons(n, noise=0.05, random_state=seed)
    x = torch.from_numpy(points).float()
    return (x - x.mean(0)) / x.std(0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "meanflow", plot="samples.png", what="one-step samples")
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    parser.add_argument(
        "--batch-size", type=int, default=512, help="global batch, split over the ranks"
    )
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (cosine)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden layer width")
    parser.add_argument("--equal-fraction", type=float, default=0.5, help="share of r = t")
    parser.add_argument("--seed", type=int, default=0, help="data, initialisation, batches")
    parser.add_argument("--compile", action="store_true", help="torch.compile the loss (fullgraph)")
    parser.add_argument("--max-mmd", type=float, default=0.03, help="exit 1 above this MMD")
    common.add_launch_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = common.launch(args, __file__)
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_data(50_000, args.seed)
    generator = torch.Generator().manual_seed(args.seed + rank)
    params = init_params(args.hidden, generator=generator, device=device)
    fdp.broadcast_params(params)  # every rank starts from rank 0's weights
    ddp = fdp.DistributedDataParallel(params)

    def loss_fn(
        params: Params, x: torch.Tensor, noise: torch.Tensor, r: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        # ddp(params) inside the function jvp transforms: the MeanFlow pattern.
        return meanflow_loss(lambda z, r, t: average_velocity(ddp(params), z, r, t), x, noise, r, t)

    step_fn = torch.compile(loss_fn, fullgraph=True) if args.compile else loss_fn
    optimizer = torch.optim.Adam([t for layer in params for t in layer.values()], lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    local = args.batch_size // world
    # Each rank draws its own batches and noise: its share of the global batch.
    generator = torch.Generator().manual_seed(1000 + args.seed + rank)
    common.log(
        f"two moons, {world} ranks ({dist.get_backend()}, {device}), global batch "
        f"{local * world}, {len(ddp.buckets)} buckets"
    )
    start = time.perf_counter()
    progress = common.Progress(range(args.steps), unit="step")
    for step in progress:
        x = data[torch.randint(len(data), (local,), generator=generator)]
        noise = torch.randn(x.shape, generator=generator)
        r, t = sample_times(local, equal_fraction=args.equal_fraction, generator=generator)
        x, noise, r, t = (v.to(device) for v in (x, noise, r, t))
        loss = step_fn(params, x, noise, r, t)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)  # the gradient buckets are averaged over the ranks here
        optimizer.step()
        schedule.step()
        progress.step(local * world)
        if step % 100 == 99 or step == args.steps - 1:  # a host sync every 100 steps only
            progress.show(loss=float(loss.detach()))  # rank 0's batch
    elapsed = time.perf_counter() - start
    common.log(f"trained {args.steps} steps in {elapsed:.1f} s ({progress.rate:.0f} samples/s)")
    return report(args, params)


def report(args: argparse.Namespace, params: Params) -> int:
    rank = dist.get_rank()
    leaves = [t.detach() for layer in params for t in layer.values()]
    reference = [t.clone() for t in leaves]
    for t in reference:
        dist.broadcast(t, src=0)
    in_sync = all(torch.equal(a, b) for a, b in zip(leaves, reference, strict=True))
    held_out = load_data(2000, args.seed + 1)
    noise = torch.randn(2000, 2, generator=torch.Generator().manual_seed(args.seed + 2))
    on_cpu = [{k: t.detach().cpu() for k, t in layer.items()} for layer in params]
    samples = one_step(on_cpu, noise)
    figures = {
        "one-step samples": mmd(samples, held_out),
        "noise (untrained)": mmd(noise, held_out),
        "second data sample": mmd(load_data(2000, args.seed + 3), held_out),
    }
    for name, value in figures.items():
        common.log(f"MMD^2 to held-out data, {name}: {value:.5f}")
    if args.plot and rank == 0:
        plot(args.plot, samples, held_out)
    if not in_sync:
        print(f"rank {rank}: parameters differ from rank 0's")
        return 1
    if figures["one-step samples"] > args.max_mmd:
        common.log(f"MMD^2 {figures['one-step samples']:.5f} is above --max-mmd {args.max_mmd}")
        return 1
    return 0


def plot(path: str, samples: torch.Tensor, data: torch.Tensor) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(8, 4), sharex=True, sharey=True)
    for ax, points, title in ((axes[0], data, "data"), (axes[1], samples, "one step")):
        ax.scatter(points[:, 0], points[:, 1], s=2, alpha=0.5)
        ax.set_title(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    common.log(f"one-step samples written to {path}")


if __name__ == "__main__":
    sys.exit(main())
