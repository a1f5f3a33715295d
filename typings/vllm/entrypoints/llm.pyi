from collections.abc import Sequence
from typing import Literal

from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.reader import Metric

class LLM:
    llm_engine: LLMEngine
    # The keyword arguments are EngineArgs fields (see the allowlist).
    def __init__(self, model: str, **kwargs: object) -> None: ...
    def generate(
        self,
        prompts: Sequence[TokensPrompt | str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: None = None,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: None = None,
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]: ...
    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> list[object]: ...
    def sleep(self, level: int = 1, mode: Literal["abort", "wait", "keep"] = "abort") -> None: ...
    def wake_up(self, tags: list[str] | None = None) -> bool | None: ...
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool: ...
    def get_metrics(self) -> list[Metric]: ...
    # A TokenizerLike (vllm/tokenizers/protocol.py in 0.32); the adapter reads encode only.
    def get_tokenizer(self) -> object: ...
    def start_profile(self, profile_prefix: str | None = None) -> None: ...
    def stop_profile(self) -> None: ...
