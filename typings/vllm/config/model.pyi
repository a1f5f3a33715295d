from vllm.config.multimodal import MultiModalConfig

class ModelConfig:
    model: str
    served_model_name: str | list[str] | None
    max_model_len: int
    enable_sleep_mode: bool
    # transformers' PretrainedConfig; read with getattr (model-specific attributes).
    hf_config: object
    multimodal_config: MultiModalConfig | None
    skip_tokenizer_init: bool
    # LogprobsMode, a Literal of four strings
    logprobs_mode: str
    max_logprobs: int
    # QuantizationMethods (a Literal of method names) | str | None
    quantization: str | None
    def get_vocab_size(self) -> int: ...
