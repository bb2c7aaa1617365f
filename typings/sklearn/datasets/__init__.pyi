from typing import Any

import numpy as np
import numpy.typing as npt

class Bunch(dict[str, Any]):
    data: npt.NDArray[np.float64]
    target: npt.NDArray[np.int64]
    images: npt.NDArray[np.float64]

def load_digits(*, n_class: int = 10, return_X_y: bool = False, as_frame: bool = False) -> Bunch: ...

def make_moons(
    n_samples: int = 100,
    *,
    shuffle: bool = True,
    noise: float | None = None,
    random_state: int | None = None,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]: ...
