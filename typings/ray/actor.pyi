from typing import Literal, overload

from ray import ObjectRef, ObjectRefGenerator
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

class ActorMethod:
    def remote(self, *args: object, **kwargs: object) -> ObjectRef[object]: ...
    # Ray streams a generator method's items with num_returns="streaming".
    def options(self, *, num_returns: Literal["streaming"]) -> _StreamingActorMethod: ...

class _StreamingActorMethod:
    def remote(self, *args: object, **kwargs: object) -> ObjectRefGenerator: ...

class ActorHandle:
    # An actor's methods are the wrapped class's, unknown here: each is an ActorMethod.
    def __getattr__(self, item: str) -> ActorMethod: ...

class ActorClass:
    def remote(self, *args: object, **kwargs: object) -> ActorHandle: ...
    @overload
    def options(
        self,
        *,
        scheduling_strategy: PlacementGroupSchedulingStrategy,
        num_cpus: float = ...,
        num_gpus: float = ...,
        runtime_env: dict[str, object] = ...,
        max_restarts: int = ...,
    ) -> ActorClass: ...
    @overload
    def options(self, **actor_options: object) -> ActorClass: ...
