from vllm.renderers.base import BaseRenderer as BaseRenderer
from vllm.renderers.params import TokenizeParams as TokenizeParams
