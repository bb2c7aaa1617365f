"""Private torch APIs fdp relies on, each behind a named function,
in a module per topic:
``_autograd`` (the engine), ``_functorch`` (``torch.func``), ``_distributed``,
``_compile`` (dynamo, inductor), ``_profiler``, ``_threads`` (what a worker
thread does not inherit) and ``_tensors`` (storage, foreach, pytree nodes).
The rest of fdp imports this package only: ``_compat.name``.

Every function says what it needs and what to do when torch changes: most
degrade to the safe answer (run replicas in a loop, never reuse a buffer)
rather than fail, and pick by capability (``getattr`` on the API), never by
version number. All are present in every release of the supported range,
torch 2.11 to 2.15, which ``nox -s torch_range`` runs the whole suite on. A
torch upgrade is checked here and by that session.
"""

from __future__ import annotations

from fdp._compat._autograd import (
    add_grad_hooks,
    any_requires_grad,
    apply_unbound,
    current_autograd_node,
    early_alias,
    hook_handles_made,
    in_backward,
    leaf_destination,
    plain_apply,
    queue_backward_callback,
    run_early,
)
from fdp._compat._compile import (
    compiler_disable,
    graph_call,
    inductor_overlap_passes,
    inductor_spmd_check_off,
    is_compiled_module,
    order_effects,
    plain_checkpoint_recomputes,
    traced_constant,
    traced_whole,
)
from fdp._compat._distributed import (
    all_gather_single,
    all_reduce_issue,
    all_reduce_sum,
    group_timeout,
    reduce_scatter_single,
    sharded_tensor,
    wait,
)
from fdp._compat._functorch import (
    any_transformed,
    dual_level_active,
    functorch_active,
    functorch_disabled,
    has_tangent,
    innermost_is_grad,
    is_transformed,
    one_jvp,
    only_reverse_transforms,
    traced_transform_keeps_backward,
    unwrap_all_functorch,
    unwrap_functorch,
)
from fdp._compat._profiler import (
    label,
    profiling,
)
from fdp._compat._tensors import (
    foreach_copy_,
    foreach_mul_,
    fused_optimizer_devices,
    fused_optimizer_kernel,
    number_as_tensor,
    registered_node,
    storage_free,
    storage_users,
)
from fdp._compat._threads import (
    default_device_modes,
    uncarried_thread_state,
)

__all__ = [
    "add_grad_hooks",
    "all_gather_single",
    "all_reduce_issue",
    "all_reduce_sum",
    "any_requires_grad",
    "any_transformed",
    "apply_unbound",
    "compiler_disable",
    "current_autograd_node",
    "default_device_modes",
    "dual_level_active",
    "early_alias",
    "foreach_copy_",
    "foreach_mul_",
    "functorch_active",
    "functorch_disabled",
    "fused_optimizer_devices",
    "fused_optimizer_kernel",
    "graph_call",
    "group_timeout",
    "has_tangent",
    "hook_handles_made",
    "in_backward",
    "inductor_overlap_passes",
    "inductor_spmd_check_off",
    "innermost_is_grad",
    "is_compiled_module",
    "is_transformed",
    "label",
    "leaf_destination",
    "number_as_tensor",
    "one_jvp",
    "only_reverse_transforms",
    "order_effects",
    "plain_apply",
    "plain_checkpoint_recomputes",
    "profiling",
    "queue_backward_callback",
    "reduce_scatter_single",
    "registered_node",
    "run_early",
    "sharded_tensor",
    "storage_free",
    "storage_users",
    "traced_constant",
    "traced_transform_keeps_backward",
    "traced_whole",
    "uncarried_thread_state",
    "unwrap_all_functorch",
    "unwrap_functorch",
    "wait",
]
