"""The last ``ddp(params)`` call's aliases, handed out again to a call with the same tensors.

Note [reused aliases]: a training loop calls ``fn(ddp(state), batch)`` every
step with the same tensors, the module's, stepped in place. Making their
aliases anew costs a node a run, a hook a leaf and the objects that hold
them, which the garbage collector then walks: at one rank ``ddp(state)``
of GPT-2's 52 leaves took 0.57 ms, 0.29 ms reused; of 200 leaves 0.85
against 0.32 ms (``benchmarks/bench_ddp_call.py``). An alias keeps
serving after an optimizer step (it is not a view: see ``_reducer``), and
an output used for several backwards is reduced in each, as with
``p = ddp(params)`` kept across steps. So a call gets the last call's
aliases back when:

- every leaf is the same object as then, with the same options, and no
  ``torch.func`` transform runs;
- the same leaves require grad;
- each alias still lies on its leaf's memory (``p.data = t`` moves a leaf),
  carries no hook but fdp's and does not retain grad (a user's hook on an
  output must not outlive the call it was registered on), and its node is
  still the one that made it (an in-place op on an alias replaces it).

Only a tree of module tensors (``nn.Parameter``, a ``make_functional``
buffer) is kept: the module holds those anyway, so keeping them holds no
memory. A tree of fresh tensors per step (a pure loop) is never kept.

The ``DistributedDataParallel`` keeps the record. The aliases' node refers
to the reducer through C++ (its context holds the call), which Python's
collector cannot follow: a record held by the reducer, or by anything the
reduction holds (a comm hook's state or closure may hold the DDP), would
make a cycle no collection frees, and a dropped DDP would keep its
parameters. So it is kept only with the default reduction or one of fdp's
hooks on a process group (:func:`safe`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from fdp._comm import _comm_hooks
from fdp._functional import module_tensor


@dataclass(frozen=True)
class Armed:
    """One call's leaves, options and what it returned, for :func:`reused`."""

    leaves: list[Any]
    options: tuple[Any, ...]
    hooked: list[int]
    aliases: list[torch.Tensor]  # one per hooked leaf
    nodes: list[Any]  # each alias's grad_fn when made
    out: list[Any]


def keep(
    leaves: list[Any],
    options: tuple[Any, ...],
    hooked: list[int],
    aliases: list[Any],
    out: list[Any],
) -> Armed | None:
    """What a later call may reuse, or ``None`` where keeping it would hold memory."""
    tensor = torch.Tensor
    if not all(module_tensor(t) for t in leaves if isinstance(t, tensor)):
        return None
    return Armed(list(leaves), options, hooked, aliases, [a.grad_fn for a in aliases], out)


def safe(reduction: Any) -> bool:
    """Whether a DDP may keep a record: nothing its reduction holds can refer back to it."""
    hook, state = reduction.hook, reduction.state
    if hook is None:
        return True
    fdps = _comm_hooks.direct(hook) is not hook
    return fdps and (state is None or isinstance(state, ProcessGroup))


def reused(
    armed: Armed | None, leaves: list[Any], options: tuple[Any, ...], hooked: list[int]
) -> list[Any] | None:
    """``armed``'s output for this call, or ``None`` where the call needs aliases of its own."""
    if (
        armed is None
        or armed.options != options
        or len(armed.leaves) != len(leaves)
        or not all(map(operator.is_, armed.leaves, leaves))
        or armed.hooked != hooked
    ):
        return None
    for i, alias, node in zip(hooked, armed.aliases, armed.nodes, strict=True):
        hooks = alias._backward_hooks
        if (
            alias.data_ptr() != leaves[i].data_ptr()
            or alias.grad_fn is not node
            or alias.retains_grad
            or hooks is None
            or len(hooks) != 1
        ):
            return None
    return list(armed.out)
