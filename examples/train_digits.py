"""Train an MLP on scikit-learn's handwritten digits with fdp.data_parallel.

The model is a pure function over a parameter pytree; every training step
splits the batch over ``--devices`` (two CPU replicas by default), runs the
replicas concurrently, gathers the logits and sums the replicas' gradients
back onto the parameters, where a stock ``torch.optim`` optimiser updates them.

    python examples/train_digits.py                       # two CPU replicas
    python examples/train_digits.py --devices cuda:0,cuda:1 --plot  # runs/digits/loss.png
    python examples/train_digits.py --compile             # torch.compile'd loss
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import common
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import fdp

Params = dict[str, list[dict[str, torch.Tensor]]]


def init_params(sizes: list[int], *, device: str, generator: torch.Generator) -> Params:
    """He-initialised weights and zero biases, one dict per layer, on ``device``."""
    layers = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        w = torch.randn(fan_in, fan_out, generator=generator) * (2.0 / fan_in) ** 0.5
        layers.append({"w": w, "b": torch.zeros(fan_out)})
    # fdp.replicate checks the device (a clear ValueError for one this machine
    # lacks, e.g. cuda:0 on a CPU-only build) and copies the tree there.
    params: Params
    (params,) = fdp.replicate({"layers": layers}, [device])
    for layer in params["layers"]:
        for leaf in layer.values():
            leaf.requires_grad_()
    return params


def mlp(params: Params, x: torch.Tensor) -> torch.Tensor:
    """The model: ReLU hidden layers, linear logits. Pure: all state is in ``params``."""
    *hidden, last = params["layers"]
    for layer in hidden:
        x = torch.relu(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def replicated_loss(
    params: Params, x: torch.Tensor, y: torch.Tensor, devices: list[str]
) -> torch.Tensor:
    logits = fdp.data_parallel(mlp, params, x, devices=devices)
    return F.cross_entropy(logits, y.to(logits.device))


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits (1797 8x8 images, shipped with scikit-learn) split 80/20, scaled to [0, 1]."""
    digits = load_digits()
    x = torch.from_numpy(digits.data).float() / 16.0
    y = torch.from_numpy(digits.target).long()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(x))
    train, test = order[:n_train], order[n_train:]
    return x[train], y[train], x[test], y[test]


def accuracy(params: Params, x: torch.Tensor, y: torch.Tensor, devices: list[str]) -> float:
    with torch.no_grad():
        logits = fdp.data_parallel(mlp, params, x, devices=devices, output_device=-1)
    return float((logits.argmax(1) == y).float().mean())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.parser(__doc__, "digits")
    parser.add_argument("--devices", default="cpu,cpu", help="comma-separated, e.g. cuda:0,cuda:1")
    common.add_digits_args(parser, batch="global batch, split over the replicas")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the loss (inductor), data_parallel inside",
    )
    parser.add_argument(
        "--min-accuracy", type=float, default=0.9, help="exit 1 below this test accuracy"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    # The parameters live where replica 0 runs; fdp copies them to the others.
    params = init_params(
        [64, args.hidden, args.hidden, 10],
        device=devices[0],
        generator=torch.Generator().manual_seed(args.seed),
    )
    leaves = [t for layer in params["layers"] for t in layer.values()]
    optimizer = torch.optim.Adam(leaves, lr=args.lr)
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test images, "
        f"{len(devices)} replicas on {devices}"
    )

    # Compiled, the loss is one graph: data_parallel runs its replicas in a loop
    # (asynchronous on GPUs), and the backward is compiled too.
    loss_fn = torch.compile(replicated_loss) if args.compile else replicated_loss
    losses: list[float] = []
    start = time.perf_counter()
    progress = common.Progress(range(args.epochs), unit="epoch")
    for _epoch in progress:
        order = torch.randperm(len(x_train))
        epoch_loss = 0.0
        for i in range(0, len(order), args.batch_size):
            idx = order[i : i + args.batch_size]
            loss = loss_fn(params, x_train[idx], y_train[idx], devices)
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            optimizer.step()
            epoch_loss += float(loss.detach()) * len(idx)
            progress.step(len(idx))
        losses.append(epoch_loss / len(order))
        progress.show(loss=losses[-1])
    elapsed = time.perf_counter() - start

    test_acc = accuracy(params, x_test, y_test, devices)
    train_acc = accuracy(params, x_train, y_train, devices)
    print(
        f"trained {args.epochs} epochs in {elapsed:.1f} s ({progress.rate:.0f} samples/s); "
        f"final epoch's mean loss {losses[-1]:.4f}"
    )
    print(f"train accuracy {train_acc:.4f}")
    print(f"test accuracy {test_acc:.4f}")
    if args.plot:
        common.save_plot(losses, args.plot, title="fdp.data_parallel on digits")
    if test_acc < args.min_accuracy:
        print(f"test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
