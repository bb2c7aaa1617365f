# The part of torchft (an optional extra) that fdp and its tests use.
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torchft import process_group as process_group

class ProcessGroupGloo:
    def __init__(self, timeout: timedelta = ...) -> None: ...
    def allreduce(self, tensors: list[Any], opts: Any) -> Any: ...

class Manager:
    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int,
        use_async_quorum: bool = ...,
        timeout: timedelta = ...,
        quorum_timeout: timedelta = ...,
        connect_timeout: timedelta = ...,
        rank: int | None = ...,
        world_size: int | None = ...,
        store_addr: str | None = ...,
        store_port: int | None = ...,
        lighthouse_addr: str | None = ...,
        replica_id: str | None = ...,
        **kwargs: Any,
    ) -> None: ...
    def start_quorum(self) -> None: ...
    def allreduce(self, tensor: Any) -> Any: ...
    def should_commit(self) -> bool: ...
    def report_error(self, e: Exception) -> None: ...
    def errored(self) -> Any: ...
    def num_participants(self) -> int: ...
    def current_step(self) -> int: ...
    def shutdown(self, wait: bool = ...) -> None: ...
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None: ...
