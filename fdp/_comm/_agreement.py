"""Checks that every rank holds the same tree, raising the same error on every rank.

Collectives over trees that differ across ranks go wrong silently (same numel,
other shapes or keys: reduced together) or abort a process (another size or
dtype: gloo raises SIGABRT). :func:`check` compares full descriptions with
``all_gather_object`` (construction time); :class:`Fingerprint` does it per
call with one tiny all-reduce and falls back to :func:`check` only to word the
error, so every rank raises the same ``ValueError`` naming the first
differing leaf.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fdp import _bucket, _compat, _tree
from fdp._comm import _launch, _training


def require_member(call: str, group: object) -> None:
    """Raises unless torch.distributed is initialized and this rank is in ``group``.

    Inside a join block (DDP's, ZeRO's), the call then announces itself
    (:func:`fdp._comm._training.before_collective`).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{call}: torch.distributed is not initialized; call fdp.init_distributed() "
            "first, in a script launched by torchrun (docs/launch.md)"
        )
    _launch.warn_if_restarts_fail(call)
    if group is not None and (not isinstance(group, ProcessGroup) or dist.get_rank(group) < 0):
        raise ValueError(
            f"{call}: `group` expected a process group that contains this process (global "
            f"rank {dist.get_rank()}); got {group!r}. dist.new_group returns a non-member "
            "placeholder on ranks outside the group: call fdp only on the group's ranks"
        )
    if group is None or isinstance(group, ProcessGroup):  # inside a join: all, or all raise
        _training.before_collective(call, group)


def check_cap(value: object, name: str, *, call: str) -> int:
    """A bucket size in MiB, validated, as bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{call}: `{name}` expected a number of MiB > 0; got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{call}: `{name}` expected a finite number of MiB > 0; got {value!r}")
    return max(1, int(value * 1024 * 1024))


def check_dtype(value: object, name: str, *, call: str) -> None:
    """Refuses a ``name`` option that is neither None nor a floating-point dtype."""
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"{call}: `{name}` expected a floating-point dtype; got {value!r}")


def signature(
    tree: Any, leaves: Sequence[Any], root: str, *, requires_grad: bool
) -> list[tuple[str, str]]:
    """Per leaf, its path and what every rank must agree on.

    Shape, dtype, device type, requires_grad where asked, and the memory
    layout where it is not contiguous (``channels_last``): a bucket packs
    each leaf in its memory order, so two layouts would sum the wrong elements.
    """
    described = []
    for p, leaf in zip(_tree.paths(tree, root), leaves, strict=True):
        if isinstance(leaf, torch.Tensor):
            what = (
                f"a tensor of shape {tuple(leaf.shape)}, dtype {leaf.dtype} on {leaf.device.type}"
            )
            strides = _bucket.dense_strides(leaf)
            if strides != _bucket.contiguous_strides(leaf.shape):
                # Buckets hold a leaf in its memory order: ranks must agree on it.
                what += f", strides {strides}"
            if requires_grad:
                what += f", requires_grad={leaf.requires_grad}"
        else:
            what = _tree.describe(leaf)
        described.append((p, what))
    return described


def check(
    mine: list[tuple[str, str]],
    *,
    group: ProcessGroup | None,
    call: str,
    arg: str,
    named: bool = False,
) -> None:
    """Raises the same ValueError on every rank unless all ranks gave the same signature.

    ``mine``: (leaf path, description) pairs of the tree ``arg``; with
    ``named``, (argument name, value) pairs of a call, and the error names
    the argument that differs.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with _compat.functorch_disabled():  # plain tensors, also under a torch.func transform
        dist.all_gather_object(gathered, mine, group=group)
    reference = gathered[0]
    for rank, theirs in enumerate(gathered[1:], start=1):
        for j in range(max(len(reference), len(theirs))):
            a = reference[j] if j < len(reference) else ("<no leaf>", "no leaf")
            b = theirs[j] if j < len(theirs) else ("<no leaf>", "no leaf")
            if a == b:
                continue
            if ERROR in (a[0], b[0]) and not named:  # a rank whose own checks raised
                faulty, said = (0, a[1]) if a[0] == ERROR else (rank, b[1])
                raise ValueError(f"{call}: rank {faulty} raised {said}")
            if named:
                raise ValueError(_named_difference(call, a, b, rank))
            raise ValueError(
                f"{call}: `{arg}` differs across ranks at leaf {j}: rank 0 has "
                f"{a[0]} = {a[1]}, rank {rank} has {b[0]} = {b[1]}"
            )


def _named_difference(call: str, a: tuple[str, str], b: tuple[str, str], rank: int) -> str:
    """The error for the first argument of a call that differs between rank 0 and ``rank``."""
    name = b[0] if a[0] == "<no leaf>" else a[0]
    if ERROR in (a[0], b[0]):  # a rank whose own checks raised; the others did not
        faulty, said = (0, a[1]) if a[0] == ERROR else (rank, b[1])
        return f"{call}: the arguments differ across ranks: rank {faulty} raised {said}"
    return f"{call}: `{name}` differs across ranks: rank 0 has {a[1]}, rank {rank} has {b[1]}"


# The entry a rank adds to a call's arguments when its own checks raised.
ERROR = "<this rank's error>"


def _device_for(group: ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Fingerprint:
    """A 62-bit hash of a tree's signature; all ranks compare theirs in one all-reduce.

    ``extra``: a second 62-bit number compared in the same all-reduce, whose
    verdict :meth:`finish` returns (the call site, :mod:`fdp._comm._call_sites`).
    """

    def __init__(self, described: list[tuple[str, str]], *, extra: int = 0) -> None:
        self.described = described
        digest = hashlib.blake2b(repr(described).encode(), digest_size=8).digest()
        self.value = int.from_bytes(digest, "little") >> 2
        self.extra = extra

    def start(self, group: ProcessGroup | None) -> tuple[torch.Tensor, Any]:
        """Launches the comparison: MAX over ranks of ``[h, -h]`` is ``[max, -min]``."""
        with _compat.functorch_disabled():
            h, e = self.value, self.extra
            mine = torch.tensor([h, -h, e, -e], dtype=torch.int64)
            mine = mine.to(_device_for(group))
            return mine, dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def finish(
        self,
        started: tuple[torch.Tensor, Any],
        *,
        group: ProcessGroup | None,
        call: str,
        arg: str,
        named: bool = False,
    ) -> bool:
        """Waits; if any rank's hash differs, every rank raises the same detailed error.

        Returns whether every rank gave the same ``extra``.
        """
        values, work = started
        work.wait()
        high, neg_low, extra_high, extra_neg_low = values.tolist()
        if high != -neg_low:
            check(self.described, group=group, call=call, arg=arg, named=named)
            raise ValueError(f"{call}: `{arg}` differs across ranks (the tree signatures differ)")
        return bool(extra_high == -extra_neg_low)


SAME_START = (
    "Give every rank the same initial values before construction: "
    "fdp.broadcast_params(params) (rank 0's), or the same seed on every rank"
)


_MASK = (1 << 62) - 1  # checksums below 2**62: their negation fits an int64
_CHUNK = 1 << 22  # elements widened to int64 at a time: the checksum's memory


def tensor_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of ``t``'s bits in logical order, on ``t``'s device.

    Equal bits give equal checksums on any device (sums modulo 2**64 do not
    depend on the order of summation); a flipped bit, -0.0 for 0.0, or two
    values swapped change them. The weights tell positions apart.
    """
    d = t.detach()
    d = torch.view_as_real(d) if d.is_complex() else d
    raw = d.contiguous().reshape(-1).view(torch.uint8)
    width = torch.int32 if raw.numel() % 4 == 0 else torch.int16 if raw.numel() % 2 == 0 else None
    words = raw.view(width) if width is not None else raw
    total = torch.zeros(2, dtype=torch.int64, device=d.device)
    for lo in range(0, words.numel(), _CHUNK):
        x = words[lo : lo + _CHUNK].to(torch.int64)
        w = torch.arange(lo, lo + x.numel(), dtype=torch.int64, device=d.device)
        w = w.remainder_(65521).add_(1)
        total += torch.stack([x.sum(), (x * w).sum()])
    return total.bitwise_and_(_MASK)


def value_fingerprint(value: Any) -> torch.Tensor:
    """Two checksums of a Python value (its pickle), as :func:`tensor_fingerprint` gives."""
    digest = hashlib.blake2b(pickle.dumps(value), digest_size=16).digest()
    return torch.tensor(
        [int.from_bytes(digest[:8], "little") & _MASK, int.from_bytes(digest[8:], "little") & _MASK]
    )


def differing(fingerprints: Sequence[torch.Tensor], group: ProcessGroup | None) -> list[bool]:
    """For each fingerprint, whether any rank holds another; one all-reduce for all of them."""
    if not fingerprints:
        return []
    with torch.no_grad(), _compat.functorch_disabled():
        mine = torch.stack([f.to(_device_for(group)) for f in fingerprints])
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        high, neg_low = both[: len(fingerprints)], both[len(fingerprints) :]
        out: list[bool] = (high != -neg_low).any(dim=1).tolist()
        return out


def check_values(
    tensors: Sequence[torch.Tensor | None],
    paths: Sequence[str],
    *,
    group: ProcessGroup | None,
    call: str,
    arg: str,
    fix: str = SAME_START,
    when: str = "at construction",
) -> None:
    """Raises the same ValueError on every rank unless every rank holds the same values.

    One all-reduce (MAX of each leaf's fingerprint and its negation) at
    construction, where fdp keeps no rank-0 copy (ZeRO, fully sharded): a rank
    starting from other values would silently train another model.
    """
    held = [(i, t) for i, t in enumerate(tensors) if t is not None]
    with torch.no_grad(), _compat.functorch_disabled():
        bad = differing([tensor_fingerprint(t) for _, t in held], group)
    for (i, _), differs in zip(held, bad, strict=True):
        if differs:
            raise ValueError(
                f"{call}: `{arg}` leaf {paths[i]} expected the same values on every rank "
                f"{when}; got different values on different ranks (their bits' checksums "
                f"differ). {fix}"
            )


@contextlib.contextmanager
def local_checks(call: str, arg: str, group: ProcessGroup | None) -> Iterator[None]:
    """A call's checks before its first collective, a :func:`check` of ``arg``.

    Where they raise on this rank only, this rank still takes part in that
    check, with its error in place of its signature: the other ranks raise
    there at once, naming this rank and its error, instead of waiting for
    it until the process group's timeout; this rank raises its own error.
    """
    try:
        yield
    except (ValueError, TypeError) as e:
        member = dist.is_available() and dist.is_initialized()
        if member and group is not None:
            member = isinstance(group, ProcessGroup) and dist.get_rank(group) >= 0
        if not member:  # no group to tell
            raise
        with contextlib.suppress(ValueError):  # the others' error names this rank
            check([(ERROR, _said(call, e))], group=group, call=call, arg=arg)
        raise  # this rank's own


def share_error(
    call: str, arg: str, tree: Any, error: Exception, group: ProcessGroup | None
) -> None:
    """Makes this rank's input error every rank's, in the signature check the others run.

    For a call whose first collective is a :class:`Fingerprint` of ``arg``'s
    signature (``requires_grad=False``): this rank takes part with its tree's
    signature and its error appended, so every rank raises the same
    ``ValueError`` naming the first difference, rather than the others
    waiting in the call's next collective. Returns where every rank had the
    same error (the caller raises it).
    """
    try:
        leaves = _tree.flatten(tree)[0]
        described = signature(tree, leaves, arg, requires_grad=False)
    except (ValueError, TypeError):
        described = []
    described.append((ERROR, _said(call, error)))
    fingerprint = Fingerprint(described)
    fingerprint.finish(fingerprint.start(group), group=group, call=call, arg=arg)


def _said(call: str, error: Exception) -> str:
    """``error`` as the other ranks' errors quote it: its type, its message without ``call``."""
    return f"{type(error).__name__}: {str(error).removeprefix(f'{call}: ')}"


def raise_together(call: str, error: Exception | None, group: ProcessGroup | None) -> None:
    """Raises on every rank where any rank's ``error`` is set; one tiny all-reduce where none is.

    For a collective call's local work (reading a file, checking a tree)
    that can fail on some ranks only: without this, the ranks that did not
    fail would wait in the call's next collective for the process group's
    timeout. The rank that failed raises its own ``error``; every other rank
    an error of the same kind (``ValueError``, ``TypeError``, else
    ``RuntimeError``) that names that rank and its message.
    """
    kind = "" if error is None else type(error).__name__
    said = "" if error is None else _said(call, error)
    fingerprint = Fingerprint([(ERROR, said)] if error is not None else [])
    values, work = fingerprint.start(group)
    work.wait()
    high, neg_low = values.tolist()[:2]
    if high != -neg_low:  # some ranks failed (or failed otherwise): every rank learns which
        gathered: list[Any] = [None] * dist.get_world_size(group)
        with _compat.functorch_disabled():
            dist.all_gather_object(gathered, (kind, said), group=group)
        if error is None:
            rank, (first, text) = next((r, g) for r, g in enumerate(gathered) if g[1])
            raised = {"ValueError": ValueError, "TypeError": TypeError}.get(first, RuntimeError)
            raise raised(f"{call}: rank {rank} raised {text}")
    if error is not None:
        raise error
