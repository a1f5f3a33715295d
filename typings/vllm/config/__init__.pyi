from vllm.config.model import ModelConfig as ModelConfig
from vllm.config.parallel import ParallelConfig as ParallelConfig
from vllm.config.speculative import SpeculativeConfig as SpeculativeConfig
from vllm.config.vllm import VllmConfig as VllmConfig
