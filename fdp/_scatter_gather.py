"""Splitting a batch across devices and joining per-replica outputs again.

Mirrors ``torch.nn.parallel.scatter_gather`` for arbitrary pytrees (optree),
on any device, CPU included. Both directions are differentiable: chunks are
``split`` views moved with ``Tensor.to`` and outputs are joined with
``torch.cat``, so autograd routes gradients back to the original batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from fdp import _batch, _tree
from fdp._device import DeviceLike, as_device, as_devices

__all__ = ["gather", "scatter", "scatter_kwargs"]

T = TypeVar("T")


def as_args(inputs: Any) -> tuple[Any, ...]:
    # A plain tuple is the positional arguments; anything else (a tensor, a
    # dict, a namedtuple batch) is the single positional argument.
    return inputs if type(inputs) is tuple else (inputs,)


def _chunk_sizes(
    batch: int, n_devices: int, chunk_sizes: Sequence[int] | None, *, call: str
) -> list[int]:
    if chunk_sizes is None:
        n = max(1, min(n_devices, batch))
        # As even as possible; the first ``batch % n`` chunks get one more.
        return [batch // n + (1 if i < batch % n else 0) for i in range(n)]
    if isinstance(chunk_sizes, (str, bytes)) or not isinstance(chunk_sizes, Sequence):
        raise TypeError(
            f"{call}: `chunk_sizes` expected a sequence of ints, one per device; "
            f"got {chunk_sizes!r}"
        )
    sizes = list(chunk_sizes)
    if len(sizes) != n_devices:
        raise ValueError(
            f"{call}: `chunk_sizes` expected one size per device ({n_devices} devices); "
            f"got {len(sizes)} sizes {sizes}"
        )
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{call}: `chunk_sizes[{i}]` expected a positive int; got {size!r}")
    if sum(sizes) != batch:
        raise ValueError(
            f"{call}: `chunk_sizes` expected sizes summing to the batch size {batch}; "
            f"got {sizes} (sum {sum(sizes)})"
        )
    return sizes


def _refuse_arrays(leaf: object, path_of: Callable[[int], str], i: int, *, call: str) -> None:
    kind = type(leaf)
    if kind.__name__ == "ndarray" and kind.__module__ == "numpy":
        shape = getattr(leaf, "shape", "?")
        raise TypeError(
            f"{call}: leaf {path_of(i)} is a numpy array of shape {shape}; fdp splits tensors "
            "only and would give every replica the whole array. Expected a tensor: convert it "
            "with torch.from_numpy (or close over it in the function if every replica needs all)"
        )


def _refuse_layouts(
    leaf: torch.Tensor, path_of: Callable[[int], str], i: int, *, call: str
) -> None:
    if leaf.is_nested or leaf.layout != torch.strided:
        got = "a nested (jagged) tensor" if leaf.is_nested else f"layout {leaf.layout}"
        raise TypeError(
            f"{call}: leaf {path_of(i)} expected a dense (strided) tensor to split along the "
            f"batch dimension; got {got}. Convert it (.to_dense()) or split it yourself"
        )


def _scatter_leaves(
    leaves: list[Any],
    path_of: Callable[[int], str],
    devices: list[torch.device],
    *,
    dim: int,
    chunk_sizes: Sequence[int] | None,
    call: str,
) -> list[list[Any]]:
    """Per device, the leaves of its chunk: tensors split along ``dim``, others shared."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{call}: `dim` expected an int; got {dim!r}")
    batch: int | None = None
    first = -1
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            _refuse_arrays(leaf, path_of, i, call=call)
            continue
        if leaf.layout != torch.strided or leaf.is_nested:
            _refuse_layouts(leaf, path_of, i, call=call)
        ndim = leaf.dim()
        if not -ndim <= dim < ndim:
            expected = f"dim in [{-ndim}, {ndim - 1}]" if ndim else "at least one dimension"
            raise ValueError(
                f"{call}: `dim` is out of range for leaf {path_of(i)}, {_tree.describe(leaf)}; "
                f"expected {expected}, got dim={dim}"
            )
        size = leaf.shape[dim]
        if batch is None:
            batch, first = size, i
        elif size != batch:
            raise ValueError(
                f"{call}: every tensor leaf must have the same size along dim {dim}; "
                f"leaf {path_of(first)} has {batch}, leaf {path_of(i)} has {size}"
            )
    if batch is None:
        # Nothing to split: one call, on the first device (as DataParallel does
        # for no inputs), rather than the same result once per device.
        return [list(leaves)]
    sizes = _chunk_sizes(batch, len(devices), chunk_sizes, call=call)
    per_device: list[list[Any]] = [[] for _ in sizes]
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            for chunk in per_device:
                chunk.append(leaf)
            continue
        # Tensor.split_with_sizes: torch.split's Python wrapper costs as much again.
        parts = leaf.split_with_sizes(sizes, dim) if len(sizes) > 1 else (leaf,)
        # ``devices`` may be longer: a small batch uses the first few.
        moved = _moved(parts, devices[: len(parts)], leaf.device)
        for chunk, part in zip(per_device, moved, strict=True):
            chunk.append(part)
    return per_device


def scatter(
    inputs: Any,
    devices: Sequence[DeviceLike],
    *,
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
) -> list[tuple[Any, ...]]:
    """Splits a batch into per-device argument tuples.

    Tensor leaves anywhere in ``inputs`` are split along ``dim`` and moved to
    their device; other leaves (ints, strings, ``None``) are shared by every
    chunk. Containers are searched for tensors: tuples, lists, dicts,
    namedtuples, their subclasses, any ``Mapping`` or ``Sequence``,
    dataclasses, and types registered with optree (any namespace) or
    ``torch.utils._pytree``; each chunk gets the user's type rebuilt around
    its part. A batch smaller than the device count gives fewer chunks, one
    per example; inputs without any tensor give one chunk.

    Args:
        inputs: a tensor, or a plain tuple of positional arguments (any other
            object counts as the single positional argument).
        devices: where chunk ``i`` goes; repeats allowed (``["cpu", "cpu"]``).
        dim: the batch dimension of every tensor leaf.
        chunk_sizes: the size of each chunk, one per device, summing to the
            batch size. Default: as even as possible.

    Returns:
        One tuple of positional arguments per used device, in device order.

    Raises:
        ValueError: ``dim`` out of range for a leaf, leaves whose batch sizes
            differ, bad ``chunk_sizes`` or empty ``devices``.
        TypeError: an object fdp cannot split holds tensors, a numpy array,
            or a sparse or nested tensor (each would otherwise reach every
            replica whole).

    Example:
        >>> import torch, fdp
        >>> chunks = fdp.scatter((torch.arange(5), "tag"), ["cpu", "cpu"])
        >>> [c[0].tolist() for c in chunks], chunks[1][1]
        ([[0, 1, 2], [3, 4]], 'tag')
    """
    call = "fdp.scatter"
    devs = as_devices(devices, call=call)
    args = as_args(inputs)
    leaves, spec = _batch.flatten(args, call=call, root="inputs")
    chunks = _scatter_leaves(
        leaves,
        lambda i: _batch.paths(spec, "inputs")[i],
        devs,
        dim=dim,
        chunk_sizes=chunk_sizes,
        call=call,
    )
    return [_batch.unflatten(spec, chunk) for chunk in chunks]


def scatter_kwargs(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devices: Sequence[DeviceLike],
    *,
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """:func:`scatter` for positional and keyword arguments together.

    Both are split with one batch size (checked across them), so chunk ``i``
    of the positional arguments goes with chunk ``i`` of the keywords.

    Example:
        >>> import torch, fdp
        >>> args, kws = fdp.scatter_kwargs(torch.ones(4, 2), {"mask": torch.ones(4)}, ["cpu"] * 2)
        >>> [a[0].shape[0] for a in args], [k["mask"].shape[0] for k in kws]
        ([2, 2], [2, 2])
    """
    call = "fdp.scatter_kwargs"
    return scatter_kwargs_to(
        inputs, kwargs, as_devices(devices, call=call), dim=dim, chunk_sizes=chunk_sizes, call=call
    )


def scatter_kwargs_to(
    inputs: Any,
    kwargs: Mapping[str, Any] | None,
    devs: list[torch.device],
    *,
    dim: int,
    chunk_sizes: Sequence[int] | None,
    call: str,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    args = as_args(inputs)
    no_kwargs = kwargs is None or (type(kwargs) is dict and not kwargs)
    if no_kwargs and chunk_sizes is None:
        plain = split_plain(args, devs, dim)
        if plain is not None:
            return plain, [{}] * len(plain)  # one empty dict: ``**`` unpacks, never mutates
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{call}: `kwargs` expected a mapping or None; got {type(kwargs).__name__}")
    kw = dict(kwargs)
    arg_leaves, arg_spec = _batch.flatten(args, call=call, root="inputs")
    kw_leaves, kw_spec = _batch.flatten(kw, call=call, root="kwargs") if kw else ([], None)
    n_args = len(arg_leaves)

    def path_of(i: int) -> str:
        if i < n_args:
            return _batch.paths(arg_spec, "inputs")[i]
        return _batch.paths(kw_spec, "kwargs")[i - n_args]

    chunks = _scatter_leaves(
        arg_leaves + kw_leaves, path_of, devs, dim=dim, chunk_sizes=chunk_sizes, call=call
    )
    return (
        [_batch.unflatten(arg_spec, c[:n_args]) for c in chunks],
        [_batch.unflatten(kw_spec, c[n_args:]) if kw else {} for c in chunks],
    )


def split_plain(
    args: tuple[Any, ...], devices: list[torch.device], dim: int
) -> list[tuple[Any, ...]] | None:
    """The common case, plain tensors only and nothing to refuse, split; else None.

    No tree to walk or rebuild, and no error to word: anything unusual
    returns None, and :func:`_scatter_leaves` splits it or explains why not.
    """
    if type(dim) is not int or not args:
        return None
    batch = -1
    for a in args:
        if type(a) is not torch.Tensor or a.layout is not _STRIDED or a.is_nested:
            return None
        ndim = a.dim()
        if not -ndim <= dim < ndim:
            return None
        size = a.shape[dim]
        if size != batch and batch >= 0:
            return None
        batch = size
    n = len(devices)
    if batch < n:
        return None
    q, r = batch // n, batch % n  # not divmod: dynamo refuses it on a symbolic batch size
    sizes = [q] * n if r == 0 else [q + 1] * r + [q] * (n - r)  # as _chunk_sizes
    per_arg = []
    for a in args:
        parts = a.split_with_sizes(sizes, dim) if n > 1 else (a,)
        where = a.device
        for device in devices:
            if device != where:
                parts = _moved(parts, devices, where)
                break
        per_arg.append(parts)
    return list(zip(*per_arg))  # noqa: B905 (every arg has one part per device)


def _moved(
    parts: Sequence[torch.Tensor], devices: list[torch.device], where: torch.device
) -> tuple[torch.Tensor, ...]:
    # non_blocking is safe only when the destination is an accelerator.
    return tuple(
        p if d == where else p.to(d, non_blocking=d.type != "cpu")
        for p, d in zip(parts, devices, strict=True)
    )


_STRIDED = torch.strided


def _same(a: object, b: object) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # e.g. arrays whose == is elementwise
        return False


def gather(outputs: Sequence[T], output_device: DeviceLike, *, dim: int = 0) -> T:
    """Joins per-replica outputs into one pytree on ``output_device``.

    Tensor leaves are concatenated along ``dim`` (differentiably); 0-dim
    tensors become a vector with one entry per replica, with a warning, as in
    DataParallel. Non-tensor leaves must be equal in every replica and are
    returned once. Dicts, lists, tuples and namedtuples keep their types.

    Args:
        outputs: one output pytree per replica, all of the same structure.
        output_device: where the result goes; ``-1`` means the CPU.
        dim: the dimension to concatenate along.

    Raises:
        ValueError: replicas returned different structures, different
            non-tensor leaves, or tensors whose shapes cannot be joined.

    Example:
        >>> import torch, fdp
        >>> out = fdp.gather([{"y": torch.zeros(2)}, {"y": torch.ones(1)}], "cpu")
        >>> out["y"].tolist()
        [0.0, 0.0, 1.0]
    """
    call = "fdp.gather"
    target = as_device(output_device, call=call, arg="output_device")
    gathered: T = gather_to(outputs, target, dim=dim, call=call)
    return gathered


def gather_to(outputs: Sequence[Any], target: torch.device, *, dim: int, call: str) -> Any:
    if type(outputs) is list and type(dim) is int:
        fast = cat_plain(outputs, target, dim)  # one tensor each: no tree to walk
        if fast is not None:
            return fast
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence) or not outputs:
        raise ValueError(f"{call}: `outputs` expected a non-empty sequence of per-replica outputs")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{call}: `dim` expected an int; got {dim!r}")
    if all(type(out) is torch.Tensor for out in outputs):
        return _join(list(outputs), lambda: "output", target, dim=dim, call=call, warned=[])
    flat = [_batch.flatten(out, call=call, root="output") for out in outputs]
    spec = flat[0][1]
    for r, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise ValueError(
                f"{call}: `outputs` replicas returned different structures; replica {r}'s "
                f"against replica 0's: {_tree.structure_difference(other, spec, 'output')}"
            )
    joined: list[Any] = []
    scalars: list[bool] = []  # whether the scalar warning was given
    for j in range(len(flat[0][0])):

        def path(j: int = j) -> str:
            return _batch.paths(spec, "output")[j]

        values = [leaves[j] for leaves, _ in flat]
        joined.append(_join(values, path, target, dim=dim, call=call, warned=scalars))
    return _batch.unflatten(spec, joined)


def cat_plain(tensors: list[torch.Tensor], target: torch.device, dim: int) -> Any:
    """The join of same-rank, same-dtype tensors on ``target``, or None: let :func:`_join` explain.

    ``torch.cat`` checks the other dimensions itself once every tensor has
    the same rank (it skips empty 1-D tensors only beside other ranks).
    """
    if not tensors or type(tensors[0]) is not torch.Tensor:
        return None
    first = tensors[0]
    ndim, dtype = first.dim(), first.dtype
    if ndim == 0 or first.device != target:  # the others: cat refuses a second device
        return None
    for t in tensors:  # a loop, not all(): a generator costs more than these checks
        if type(t) is not torch.Tensor or t.dtype is not dtype or t.dim() != ndim:
            return None
    if len(tensors) == 1:
        return first
    try:
        return torch.cat(tensors, dim)
    except (RuntimeError, IndexError):  # _join raises the clear error
        return None


def _join(
    values: list[Any],
    path: Callable[[], str],
    target: torch.device,
    *,
    dim: int,
    call: str,
    warned: list[bool],
) -> Any:
    """One output leaf from every replica, joined (tensors) or checked equal (others)."""
    is_tensor = [isinstance(v, torch.Tensor) for v in values]
    if not any(is_tensor):
        for r, value in enumerate(values[1:], start=1):
            if not _same(value, values[0]):
                raise ValueError(
                    f"{call}: `outputs` non-tensor leaf {path()} differs between replicas; "
                    f"expected (replica 0) {values[0]!r}, got (replica {r}) {value!r}; "
                    "return a tensor to have it gathered"
                )
        return values[0]
    if not all(is_tensor):
        r = is_tensor.index(not is_tensor[0])
        raise ValueError(
            f"{call}: `outputs` leaf {path()} is {_tree.describe(values[0])} in replica 0 "
            f"but {_tree.describe(values[r])} in replica {r}"
        )
    tensors: list[torch.Tensor] = values
    if all(t.dim() == 0 for t in tensors):
        if not warned:
            warnings.warn(
                f"{call}: asked to gather along dimension {dim}, but some outputs "
                "are scalars; they are returned as a vector with one entry per replica",
                UserWarning,
                stacklevel=4,
            )
            warned.append(True)
        tensors = [t.reshape(1) for t in tensors]
        leaf_dim = 0
    else:
        leaf_dim = _check_joinable(tensors, dim, path, call=call)
    if len(tensors) == 1 and tensors[0].device == target:
        return tensors[0]
    return torch.cat([t if t.device == target else t.to(target) for t in tensors], leaf_dim)


def _check_joinable(
    tensors: list[torch.Tensor], dim: int, path: Callable[[], str], *, call: str
) -> int:
    ndim = tensors[0].dim()
    if not -ndim <= dim < ndim:
        expected = f"dim in [{-ndim}, {ndim - 1}]" if ndim else "at least one dimension"
        raise ValueError(
            f"{call}: `dim` is out of range for output leaf {path()}, "
            f"{_tree.describe(tensors[0])}; expected {expected}, got dim={dim}"
        )
    d = dim % ndim
    expected_shape = tensors[0].shape[:d] + tensors[0].shape[d + 1 :]
    for r, t in enumerate(tensors[1:], start=1):
        if t.dim() != ndim or t.shape[:d] + t.shape[d + 1 :] != expected_shape:
            raise ValueError(
                f"{call}: output leaf {path()} cannot be joined along dim {dim}: "
                f"expected (replica 0) shape {tuple(tensors[0].shape)} in every other "
                f"dimension, got (replica {r}) {tuple(t.shape)}"
            )
        if t.dtype != tensors[0].dtype:
            raise ValueError(
                f"{call}: output leaf {path()} has dtype {tensors[0].dtype} in replica 0 "
                f"but {t.dtype} in replica {r}"
            )
    return d
