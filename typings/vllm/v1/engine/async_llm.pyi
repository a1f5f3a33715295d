from abc import ABCMeta
from collections.abc import AsyncGenerator, Iterable
from typing import Literal

from vllm.config import VllmConfig
from vllm.config.model import ModelConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.renderers import BaseRenderer
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.core_client import AsyncMPClient
from vllm.v1.engine.output_processor import OutputProcessor

class AsyncLLM(metaclass=ABCMeta):
    vllm_config: VllmConfig
    model_config: ModelConfig
    log_stats: bool
    output_processor: OutputProcessor
    engine_core: AsyncMPClient
    renderer: BaseRenderer
    @classmethod
    def from_engine_args(
        cls,
        engine_args: AsyncEngineArgs,
        start_engine_loop: bool = True,
        usage_context: object = ...,
        stat_loggers: None = None,
    ) -> AsyncLLM: ...
    def shutdown(self, timeout: float | None = None) -> None: ...
    def get_num_unfinished_requests(self) -> int: ...
    def generate(
        self,
        prompt: TokensPrompt | str,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput]: ...
    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None: ...
    async def pause_generation(
        self, *, mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True
    ) -> None: ...
    async def resume_generation(self) -> None: ...
    async def is_paused(self) -> bool: ...
    async def reset_mm_cache(self) -> None: ...
    async def reset_encoder_cache(self) -> None: ...
    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool: ...
    async def sleep(
        self, level: int = 1, mode: Literal["abort", "wait", "keep"] = "abort"
    ) -> None: ...
    async def wake_up(self, tags: list[str] | None = None) -> bool: ...
    async def is_sleeping(self) -> bool: ...
    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> list[object]: ...
    @property
    def errored(self) -> bool: ...
