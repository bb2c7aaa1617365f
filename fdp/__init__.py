"""fdp: functional data parallelism for PyTorch."""

from fdp.data_parallel import data_parallel as data_parallel
from fdp.data_parallel import make_functional as make_functional
from fdp.parallel_apply import parallel_apply as parallel_apply
from fdp.replicate import replicate as replicate
from fdp.scatter_gather import gather as gather
from fdp.scatter_gather import scatter as scatter
from fdp.scatter_gather import scatter_kwargs as scatter_kwargs

__version__ = "0.1.0"

__all__ = [
    "data_parallel",
    "gather",
    "make_functional",
    "parallel_apply",
    "replicate",
    "scatter",
    "scatter_kwargs",
]
