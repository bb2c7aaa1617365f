"""Functional optimizers over parameter pytrees: ``sgd``, ``adam``, ``adamw``, ``muon``.

Each returns an optimizer with ``init(params) -> state`` and
``update(grads, state, params) -> (params, state)``, pure and traceable
(``fdp/optim/_base.py``, ``fdp/optim/_rules.py``). Around them, what a training loop needs:
``param_groups`` (per-leaf hyperparameters), ``clip_by_global_norm`` and
``GradScaler`` (float16 loss scaling), and learning-rate schedules
(``linear_schedule``, ``cosine_decay_schedule``, ``join_schedules``, ...)
to pass as ``lr``.
"""

from fdp.optim._base import Optimizer as Optimizer
from fdp.optim._base import OptimizerProtocol as OptimizerProtocol
from fdp.optim._clip import clip_by_global_norm as clip_by_global_norm
from fdp.optim._grad_scaler import GradScaler as GradScaler
from fdp.optim._muon import Muon as Muon
from fdp.optim._muon import muon as muon
from fdp.optim._param_groups import ParamGroups as ParamGroups
from fdp.optim._param_groups import param_groups as param_groups
from fdp.optim._rules import SGD as SGD
from fdp.optim._rules import Adam as Adam
from fdp.optim._rules import adam as adam
from fdp.optim._rules import adamw as adamw
from fdp.optim._rules import sgd as sgd
from fdp.optim._schedules import constant_schedule as constant_schedule
from fdp.optim._schedules import cosine_decay_schedule as cosine_decay_schedule
from fdp.optim._schedules import join_schedules as join_schedules
from fdp.optim._schedules import linear_schedule as linear_schedule
from fdp.optim._schedules import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from fdp.optim._split import split_transforms as split_transforms
from fdp.optim._whole import WholeLeafOptimizer as WholeLeafOptimizer

__all__ = [
    "SGD",
    "Adam",
    "GradScaler",
    "Muon",
    "Optimizer",
    "OptimizerProtocol",
    "ParamGroups",
    "WholeLeafOptimizer",
    "adam",
    "adamw",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "linear_schedule",
    "muon",
    "param_groups",
    "sgd",
    "split_transforms",
    "warmup_cosine_decay_schedule",
]
