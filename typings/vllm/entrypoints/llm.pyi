from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, overload

import torch
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.renderers import BaseRenderer
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.reader import Metric

_R = TypeVar("_R")

class LLM:
    llm_engine: LLMEngine
    renderer: BaseRenderer
    # The keyword arguments are EngineArgs fields (see the allowlist).
    def __init__(self, model: str, **kwargs: object) -> None: ...
    def generate(
        self,
        prompts: Sequence[TokensPrompt | TextPrompt | str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: Sequence[LoRARequest | None] | LoRARequest | None = None,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: None = None,
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]: ...
    @overload
    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> list[object]: ...
    @overload
    def collective_rpc(
        self,
        method: Callable[..., _R],
        timeout: float | None = None,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> list[_R]: ...
    def apply_model(self, func: Callable[[torch.nn.Module], _R]) -> list[_R]: ...
    def sleep(self, level: int = 1, mode: Literal["abort", "wait", "keep"] = "abort") -> None: ...
    def wake_up(self, tags: list[str] | None = None) -> bool | None: ...
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool: ...
    def reset_mm_cache(self) -> None: ...
    def get_metrics(self) -> list[Metric]: ...
    def start_profile(self, profile_prefix: str | None = None) -> None: ...
    def stop_profile(self) -> None: ...
