# Narrow hand-written stubs: only the vLLM surface genworker's shell uses.
from vllm.engine.arg_utils import EngineArgs as EngineArgs
from vllm.entrypoints.llm import LLM as LLM
from vllm.inputs import TokensPrompt as TokensPrompt
from vllm.outputs import CompletionOutput as CompletionOutput
from vllm.outputs import RequestOutput as RequestOutput
from vllm.sampling_params import SamplingParams as SamplingParams

__version__: str
