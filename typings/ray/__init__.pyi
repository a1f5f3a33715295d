# Hand-written, narrow: the names genworker (shell/group.py, shell/nemo_rl.py,
# shell/host.py) and its tests use, checked against Ray by stubtest (make typecheck).
# A result crosses Ray as `object`: the caller checks what it got.
from collections.abc import Generator, Sequence
from typing import Generic, TypeVar, overload

from typing_extensions import disjoint_base

from ray import actor as actor
from ray import exceptions as exceptions
from ray import util as util
from ray.actor import ActorClass, ActorHandle
from ray.runtime_context import RuntimeContext

_T = TypeVar("_T")
_C = TypeVar("_C")

@disjoint_base
class ObjectRef(Generic[_T]):
    def __await__(self) -> Generator[object, None, _T]: ...

class ObjectRefGenerator:
    def is_finished(self) -> bool: ...
    def __aiter__(self) -> ObjectRefGenerator: ...
    async def __anext__(self) -> ObjectRef[object]: ...

def init(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    resources: dict[str, float] | None = None,
    labels: dict[str, str] | None = None,
    object_store_memory: int | None = None,
    local_mode: bool = False,
    ignore_reinit_error: bool = False,
    include_dashboard: bool | None = None,
    dashboard_host: str = ...,
    dashboard_port: int | None = None,
    job_config: object = None,
    configure_logging: bool = True,
    logging_level: int | str = ...,
    logging_format: str | None = None,
    logging_config: object = None,
    log_to_driver: bool | None = None,
    namespace: str | None = None,
    runtime_env: dict[str, object] | None = None,
    enable_resource_isolation: bool = False,
    cgroup_path: str | None = None,
    system_reserved_cpu: float | None = None,
    system_reserved_memory: int | None = None,
    proxy_server_url: str | None = None,
    **kwargs: object,
) -> object: ...
def is_initialized() -> bool: ...
def shutdown(*, wait_for_processes: bool = False, _exiting_interpreter: bool = False) -> None: ...
@overload
def get(object_refs: ObjectRef[_T], *, timeout: float | None = None) -> _T: ...
@overload
def get(object_refs: Sequence[ObjectRef[_T]], *, timeout: float | None = None) -> list[_T]: ...
def wait(
    ray_waitables: list[ObjectRef[_T]],
    *,
    num_returns: int = 1,
    timeout: float | None = None,
    fetch_local: bool = True,
) -> tuple[list[ObjectRef[_T]], list[ObjectRef[_T]]]: ...
def kill(actor: ActorHandle, *, no_restart: bool = True) -> None: ...
def cancel(
    ray_waitable: ObjectRef[object] | ObjectRefGenerator,
    *,
    force: bool = False,
    recursive: bool = True,
) -> None: ...
def remote(cls: type[_C], /) -> ActorClass: ...
def available_resources() -> dict[str, float]: ...
def cluster_resources() -> dict[str, float]: ...
def get_runtime_context() -> RuntimeContext: ...
