from abc import ABCMeta
from typing import Literal

# AsyncLLM.engine_core (EngineCoreClient.make_async_mp_client's AsyncMPClient, or a
# data-parallel subclass of it); genworker pauses the scheduler through it.
class AsyncMPClient(metaclass=ABCMeta):
    async def pause_scheduler_async(
        self, mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True
    ) -> None: ...
