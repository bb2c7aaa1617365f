"""Functional optimizers over parameter pytrees: ``sgd``, ``adam``, ``adamw``.

Each returns an optimizer with ``init(params) -> state`` and
``update(grads, state, params) -> (params, state)``, pure and traceable
(``fdp/_optim.py``, ``fdp/_optim_rules.py``). Around them, what a training loop needs:
``param_groups`` (per-leaf hyperparameters), ``clip_by_global_norm`` and
``GradScaler`` (float16 loss scaling).
"""

from fdp._clip import clip_by_global_norm as clip_by_global_norm
from fdp._grad_scaler import GradScaler as GradScaler
from fdp._optim import Optimizer as Optimizer
from fdp._optim import OptimizerProtocol as OptimizerProtocol
from fdp._optim_rules import SGD as SGD
from fdp._optim_rules import Adam as Adam
from fdp._optim_rules import adam as adam
from fdp._optim_rules import adamw as adamw
from fdp._optim_rules import sgd as sgd
from fdp._param_groups import ParamGroups as ParamGroups
from fdp._param_groups import param_groups as param_groups

__all__ = [
    "SGD",
    "Adam",
    "GradScaler",
    "Optimizer",
    "OptimizerProtocol",
    "ParamGroups",
    "adam",
    "adamw",
    "clip_by_global_norm",
    "param_groups",
    "sgd",
]
