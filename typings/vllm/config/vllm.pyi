from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig

class VllmConfig:
    model_config: ModelConfig
    parallel_config: ParallelConfig
