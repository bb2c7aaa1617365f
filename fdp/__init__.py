"""fdp: functional data parallelism for PyTorch."""

from fdp import optim as optim
from fdp._caches import clear_caches as clear_caches
from fdp._comm._comm_hooks import CommHook as CommHook
from fdp._comm._comm_hooks import GradBucket as GradBucket
from fdp._comm._comm_hooks import allreduce_hook as allreduce_hook
from fdp._comm._comm_hooks import bf16_compress_hook as bf16_compress_hook
from fdp._comm._comm_hooks import bf16_wire_hook as bf16_wire_hook
from fdp._comm._comm_hooks import fp16_compress_hook as fp16_compress_hook
from fdp._comm._launch import init_distributed as init_distributed
from fdp._comm._sync_batch_norm import sync_batch_norm as sync_batch_norm
from fdp._comm._tensor_collectives import all_gather as all_gather
from fdp._comm._tensor_collectives import all_reduce as all_reduce
from fdp._comm._tensor_collectives import all_to_all as all_to_all
from fdp._comm._tensor_collectives import broadcast as broadcast
from fdp._comm._tensor_collectives import reduce_scatter as reduce_scatter
from fdp._comm._tree_collectives import all_reduce_grads as all_reduce_grads
from fdp._comm._tree_collectives import broadcast_params as broadcast_params
from fdp._data_parallel import data_parallel as data_parallel
from fdp._ddp._ddp import DistributedDataParallel as DistributedDataParallel
from fdp._ddp._traced import overlap_options as overlap_options
from fdp._ft._diloco import DiLoCo as DiLoCo
from fdp._ft._diloco import LocalSGD as LocalSGD
from fdp._ft._fault_tolerance import FaultTolerance as FaultTolerance
from fdp._functional import make_functional as make_functional
from fdp._grad import grad as grad
from fdp._grad import grad_and_value as grad_and_value
from fdp._parallel_apply import parallel_apply as parallel_apply
from fdp._replicate import replicate as replicate
from fdp._scatter_gather import gather as gather
from fdp._scatter_gather import scatter as scatter
from fdp._scatter_gather import scatter_kwargs as scatter_kwargs
from fdp._sharding._checkpoint import load_checkpoint as load_checkpoint
from fdp._sharding._checkpoint import save_checkpoint as save_checkpoint
from fdp._sharding._fsdp import FullyShardedDataParallel as FullyShardedDataParallel
from fdp._sharding._latest import latest_checkpoint as latest_checkpoint
from fdp._sharding._per_rank import PerRank as PerRank
from fdp._sharding._shards import ZeroState as ZeroState
from fdp._sharding._zero import ZeroRedundancy as ZeroRedundancy
from fdp._version import __version__ as __version__

__all__ = [
    "CommHook",
    "DiLoCo",
    "DistributedDataParallel",
    "FaultTolerance",
    "FullyShardedDataParallel",
    "GradBucket",
    "LocalSGD",
    "PerRank",
    "ZeroRedundancy",
    "ZeroState",
    "all_gather",
    "all_reduce",
    "all_reduce_grads",
    "all_to_all",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_wire_hook",
    "broadcast",
    "broadcast_params",
    "clear_caches",
    "data_parallel",
    "fp16_compress_hook",
    "gather",
    "grad",
    "grad_and_value",
    "init_distributed",
    "latest_checkpoint",
    "load_checkpoint",
    "make_functional",
    "optim",
    "overlap_options",
    "parallel_apply",
    "reduce_scatter",
    "replicate",
    "save_checkpoint",
    "scatter",
    "scatter_kwargs",
    "sync_batch_norm",
]
