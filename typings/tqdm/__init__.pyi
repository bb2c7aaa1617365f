# The parts of tqdm that fdp's examples use (tqdm ships no types).
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

_T = TypeVar("_T")

class tqdm(Generic[_T]):
    def __init__(
        self,
        iterable: Iterable[_T] | None = None,
        desc: str | None = None,
        total: int | None = None,
        leave: bool = True,
        disable: bool | None = False,
        unit: str = "it",
        **kwargs: Any,
    ) -> None: ...
    def __iter__(self) -> Iterator[_T]: ...
    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None: ...
    @classmethod
    def write(cls, s: str, file: Any = None, end: str = "\n", nolock: bool = False) -> None: ...
    def close(self) -> None: ...

def trange(*args: int, **kwargs: Any) -> tqdm[int]: ...
