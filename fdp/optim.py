"""Functional optimizers over parameter pytrees: ``sgd``, ``adam``, ``adamw``.

Each returns an optimizer with ``init(params) -> state`` and
``update(grads, state, params) -> (params, state)``, pure and traceable
(``fdp/_optim.py``).
"""

from fdp._optim import SGD as SGD
from fdp._optim import Adam as Adam
from fdp._optim import Optimizer as Optimizer
from fdp._optim import adam as adam
from fdp._optim import adamw as adamw
from fdp._optim import sgd as sgd

__all__ = ["SGD", "Adam", "Optimizer", "adam", "adamw", "sgd"]
