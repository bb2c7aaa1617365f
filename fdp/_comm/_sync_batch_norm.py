"""``sync_batch_norm``: batch norm over the batches of every rank.

Each rank holds its own part of the global batch. The statistics are taken
over all of it: every rank takes its own count, mean and biased variance
per channel (torch's exact two-pass kernel), one all-gather collects them,
and each rank combines them (Chan's parallel formula), so ranks may hold
batches of different sizes, 0 included, and a channel whose mean is far
larger than its spread keeps its variance (summing x and x^2 instead loses
it to cancellation). Backward needs two more sums per channel over the
global batch (of ``dy`` and of ``dy * (x - mean)``, again exact): one
all-reduce. The gradients of ``weight`` and ``bias`` are this rank's share
(its own sums), as with ``torch.nn.SyncBatchNorm``: summed over ranks they
are the global batch norm's, and DDP averages them.

The collectives run eagerly under ``loss.backward()`` and ``torch.func.grad``
(with functorch's dispatch disabled, on plain tensors: a collective is not
differentiable), and as functional collectives while compiling. Inside
``DistributedDataParallel.join`` they run among the ranks still training
(``fdp/_ddp/_join.py``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from fdp import _compat, _mode
from fdp._comm import _differentiable, _training, _transforms

Group = _training.Group


def _summed(t: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over the ranks of ``group`` of ``t`` (a new tensor).

    ``_differentiable``'s collectives, as everywhere; inside this op's own
    Function nothing records them (its backward is the rule).
    """
    if isinstance(group, _training.Alone):
        return t
    return _differentiable.psum(t, group=group)


def _gathered(t: torch.Tensor, group: Group) -> torch.Tensor:
    """``t`` (1-d) from every rank of ``group``, one row per rank."""
    if isinstance(group, _training.Alone):
        return t.view(1, -1)
    policy = _differentiable.Policy(group, dist.get_world_size(group))
    return _differentiable.all_gather_flat(t, policy).view(-1, t.numel())


def _mean_var_traced(wide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_mean_var` from ``var_mean``: a batch of another size compiles with a
    symbolic shape, which ``batch_norm_update_stats`` has no fake-tensor kernel for."""
    var, mean = torch.var_mean(wide, [0, *range(2, wide.dim())], correction=0)
    return mean, var


@_mode.traced_as(_mean_var_traced)
def _mean_var(wide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-channel mean and biased variance (the fused kernel)."""
    mean, var = torch.batch_norm_update_stats(wide, None, None, 0.0)
    return mean, var


def _statistics(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, ...]:
    """The global batch's (mean, biased variance, count), per channel, in float32 or wider."""
    c = x.shape[1]
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    n = x.numel() // max(c, 1)
    if n:
        mean, var = _mean_var(wide)
    else:  # torch's kernels divide by the count
        mean = var = wide.new_zeros(c)
    rows = _gathered(torch.cat([wide.new_full((1,), n), mean, var]), group)
    counts, means, variances = rows[:, :1], rows[:, 1 : c + 1], rows[:, c + 1 :]
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
    return mean, var, total


def _composite(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, group: Group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused forward from differentiable ops, for transforms and double backward.

    The statistics travel through :func:`_differentiable.all_gather`, whose
    derivatives are collectives too, so every transform (and the derivative
    of this backward) follows from the ops: the psum rule. Same numbers as
    the fused path (exact per-rank statistics, Chan's formula).
    """
    c = x.shape[1]
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    n = x.numel() // max(c, 1)
    dims = [0, *range(2, x.dim())]
    if n:
        var, mean = torch.var_mean(wide, dims, correction=0)
    else:  # zeros that depend on x, so that every rank runs the same derivatives
        mean = var = wide.sum(dims)
    row = torch.cat([torch.full((1,), float(n), dtype=wide.dtype, device=x.device), mean, var])
    if group is _training.ALONE:
        rows = row.view(1, -1)
    else:
        rows = _differentiable.all_gather(row, cast(ProcessGroup | None, group))
    counts, means, variances = rows[:, :1], rows[:, 1 : c + 1], rows[:, c + 1 :]
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
    shape = [1, c] + [1] * (x.dim() - 2)
    scale = torch.rsqrt(var + eps) * weight
    shift = bias - mean * scale
    y = (wide * scale.view(shape) + shift.view(shape)).to(x.dtype)
    return y, mean.detach(), var.detach(), total.detach()


class _SyncBatchNorm(torch.autograd.Function):
    """Normalises ``x`` with the global mean and variance; returns (y, mean, biased var, count)."""

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        group: Group,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, var, n = _statistics(x, group)
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        scale = torch.rsqrt(var + eps) * weight
        shift = bias - mean * scale
        y = torch.addcmul(shift.to(x.dtype).view(shape), x, scale.to(x.dtype).view(shape))
        return y, mean, var, n

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, weight, _bias, eps, group = inputs
        _y, mean, var, n = output
        ctx.save_for_backward(x, weight, mean, var, n)
        ctx.eps, ctx.group = eps, group
        ctx.mark_non_differentiable(mean, var, n)

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor, *_: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        x, weight, mean, var, n = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            return _double_backward(ctx, x, weight, dy)
        c = x.shape[1]
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + ctx.eps)
        if x.numel():
            # sum(dy) and sum(dy * (x - mean)) in one exact pass.
            _, sum_dy_xmu, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy,
                x,
                None,
                None,
                None,
                mean,
                torch.ones_like(mean),
                True,
                ctx.eps,
                [False, True, True],
            )
        else:
            # Zeros that depend on dy: made from nothing, the compiled
            # partitioner would move this rank's all-reduce into forward.
            sum_dy_xmu = sum_dy = dy.sum([0, *range(2, dy.dim())]).to(mean.dtype)
        total = _summed(torch.cat([sum_dy, sum_dy_xmu]), ctx.group)
        g_dy, g_dy_xmu = total[:c] / n, total[c:] / n
        # dx = a * (dy - g_dy - (x - mean) * k), as two fused multiply-adds.
        # Not centring x first saves a pass; the cancellation it allows is
        # linear in |mean| / std (6e-5 of dx at 1000), unlike the variance's.
        a = invstd * weight
        k = invstd * invstd * g_dy_xmu
        dx = torch.addcmul((a * (mean * k - g_dy)).view(shape), dy, a.view(shape))
        dx = torch.addcmul(dx, x, (-a * k).view(shape))
        w_dtype = weight.dtype
        return dx.to(x.dtype), (sum_dy_xmu * invstd).to(w_dtype), sum_dy.to(w_dtype), None, None


def _double_backward(
    ctx: Any, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
    """The gradients through :func:`_composite`, recording their own graph (create_graph)."""
    y = _composite(x, weight, torch.zeros_like(weight), ctx.eps, ctx.group)[0]
    wanted = [t for t in (x, weight) if t.requires_grad]
    found = iter(torch.autograd.grad(y, wanted, dy, create_graph=True))
    dx, dw = (next(found) if t.requires_grad else None for t in (x, weight))
    db = dy.sum([0, *range(2, dy.dim())]).to(weight.dtype)
    return dx, dw, db, None, None  # type: ignore[return-value]


@_transforms.eager_under_transforms("fdp.sync_batch_norm")
def sync_batch_norm(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Batch norm whose statistics are taken over the batches of every rank.

    Arguments as ``torch.nn.functional.batch_norm``: ``x`` is ``(N, C, *)``
    (BatchNorm1d/2d/3d shapes); ``N`` may differ between ranks, 0 included.
    In training the running statistics are updated in place, with the
    global batch's mean and unbiased variance. In evaluation (or with
    ``training=False``) it is ``F.batch_norm`` with the running statistics,
    and communicates nothing. Every rank of ``group`` must call it the same
    number of times in the same order. Inside ``ddp.join()`` the statistics
    are taken over the ranks still training (call it eagerly there).

    Example::

        y = fdp.sync_batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias)
    """
    if x.dim() < 2:
        raise ValueError(
            f"fdp.sync_batch_norm: `x` expected shape (N, C, *); got shape {tuple(x.shape)}"
        )
    if isinstance(momentum, bool) or not isinstance(momentum, int | float):
        raise TypeError(
            f"fdp.sync_batch_norm: `momentum` expected a float; got {momentum!r} (for "
            "BatchNorm's momentum=None, a cumulative average, pass 1 / num_batches_tracked)"
        )
    if not training:
        return F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    c = x.shape[1]
    w = weight if weight is not None else torch.ones(c, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else torch.zeros(c, dtype=x.dtype, device=x.device)
    group_ = _training.training_group(group)
    if _mode.transformed((x, w, b)):
        y, mean, var, n = _composite(x, w, b, eps, group_)
    else:
        y, mean, var, n = _SyncBatchNorm.apply(x, w, b, eps, group_)  # type: ignore[no-untyped-call]
    count = _count(n)
    if count == 1:  # the same on every rank: every rank raises it
        raise ValueError(
            "fdp.sync_batch_norm: `x` expected more than 1 value per channel in the global "
            f"batch when training (as F.batch_norm); got 1 over all ranks (this rank's x has "
            f"shape {tuple(x.shape)})"
        )
    if running_mean is not None and running_var is not None and count != 0:
        _update_running(running_mean, running_var, mean, var * n / (n - 1).clamp_min(1), momentum)
    out: torch.Tensor = y
    return out


def _count_traced(n: torch.Tensor) -> int | None:
    return None  # reading a value would break the graph


@_mode.traced_as(_count_traced)
def _count(n: torch.Tensor) -> int | None:
    """The global batch's values per channel, where it can be read (None under a transform)."""
    if _mode.transform_running():
        return None
    return int(n.reshape(-1)[0])


def _update_running_traced(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    momentum: float,
) -> None:
    with torch.no_grad():
        running_mean.lerp_(mean.to(running_mean.dtype), momentum)
        running_var.lerp_(var.to(running_var.dtype), momentum)


@_mode.traced_as(_update_running_traced)
def _update_running(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    momentum: float,
) -> None:
    """``F.batch_norm``'s in-place update of the running statistics."""
    # Under torch.func the statistics are wrapped at the transform's level,
    # while the buffers are plain tensors the transform captured.
    with torch.no_grad(), _compat.functorch_disabled():
        if _mode.wrapped([_compat.unwrap_functorch(mean)]):
            raise ValueError(
                "fdp.sync_batch_norm: under torch.vmap each vmapped slice has its own batch "
                "statistics, which cannot update `running_mean` and `running_var` in place "
                "(F.batch_norm refuses the same); pass running_mean=None and running_var=None "
                "(track_running_stats=False), or call it outside vmap"
            )
        for buf, new in ((running_mean, mean), (running_var, var)):
            target = _compat.unwrap_functorch(buf)
            target.lerp_(_compat.unwrap_functorch(new).to(target.dtype), momentum)


def _synced_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward`` with :func:`sync_batch_norm` for the batch statistics."""
    self._check_input_dim(x)
    momentum = 0.0 if self.momentum is None else self.momentum
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        with torch.no_grad(), _compat.functorch_disabled():  # a captured buffer under torch.func
            _compat.unwrap_functorch(self.num_batches_tracked).add_(1)
        if self.momentum is None:  # a cumulative moving average
            momentum = 1.0 / float(self.num_batches_tracked)
    batch_stats = self.training or (self.running_mean is None and self.running_var is None)
    tracked = not self.training or self.track_running_stats
    if not batch_stats:
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )
    if not self.training:  # no running statistics in eval: local ones, as SyncBatchNorm
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
    # nn.SyncBatchNorm's own process_group wins over make_functional's group.
    group = getattr(self, "process_group", None) or self.__dict__.get("_fdp_group")
    return sync_batch_norm(
        x,
        self.running_mean if tracked else None,
        self.running_var if tracked else None,
        self.weight,
        self.bias,
        momentum=momentum,
        eps=self.eps,
        group=group,
    )


# One subclass per batch-norm class, made once: a shell's class is swapped
# for it (an attribute per instance would tie the shell to itself in a cycle).
_SYNCED: dict[type, type] = {}


def synced(shell: torch.nn.Module, group: ProcessGroup | None) -> None:
    """Makes a shell of a ``BatchNorm*d`` module normalise with :func:`sync_batch_norm`."""
    cls = type(shell)
    if cls not in _SYNCED:
        _SYNCED[cls] = type(f"Synced{cls.__name__}", (cls,), {"forward": _synced_forward})
    shell.__class__ = _SYNCED[cls]
    shell.__dict__["_fdp_group"] = group
