"""Every key of NeMo-RL's generation config, and what genworker does with it: the table.

Theory of operation
-------------------
NeMo-RL hands its vLLM worker the ``policy.generation`` dict (``GenerationConfig`` in
``nemo_rl/models/generation/interfaces.py``, ``VllmConfig`` / ``VllmSpecificArgs`` in
``nemo_rl/models/generation/vllm/config.py``, read at NeMo-RL commit 7ea279ab). A key that
parses and then does nothing is a bug, so :data:`KEYS` gives each key one :class:`Fate`:

* ``HONOURED``: the worker does what the key says (``config.py`` parses it).
* ``NEMO_RL_SIDE``: not the worker's key. NeMo-RL's own layers read it (``VllmGeneration``,
  GRPO setup, another backend's block), or NeMo-RL reads it only beside a key this table
  refuses; NeMo-RL's own vLLM worker does not read it either. Accepted as it is.
* ``ASYNC_WORKER`` / ``HTTP_SERVER``: keys of the async worker and of the OpenAI server,
  which their own modules parse; accepted here.
* ``REFUSED``: a :class:`~genworker.core.config.ConfigProblem` naming the key and what to
  use instead, unless the value is one of the rule's ``inert`` values: NeMo-RL's defaults
  that ask for nothing (``use_deep_gemm: false``, ``quant_cfg: null``), accepted because
  genworker already does nothing there.

An honoured key's value is checked by the parser (``config.py``), which may still refuse
some values by name, and the worker may refuse a value once it knows the engine:
``vllm_cfg.reset_encoder_cache_after_weight_update: false`` is accepted on a text-only
model (there is no encoder cache to keep) and refused on a multimodal one (the worker
always resets the encoder and multimodal caches after a refit).

A rule whose key ends in ``.*`` covers a whole block (its sub-keys are not looked at);
``vllm_kwargs`` is passed to vLLM, so only the ``vllm_kwargs.<name>`` rules below are
checked there. Any other key is refused as unknown: a typo or a key of a NeMo-RL version
this table does not know.

Boolean values are read as vLLM reads them (its configs are pydantic dataclasses, so
pydantic's lax rules apply): ``true``/``false``, ``0``/``1`` and the strings of
:data:`TRUE_STRINGS` / :data:`FALSE_STRINGS` in any case (``"False"`` from a command-line
override is false).
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Mapping
from typing import Final

import attrs

__all__ = [
    "FALSE_STRINGS",
    "KEYS",
    "TRUE_STRINGS",
    "Fate",
    "KeyRule",
    "KeyVerdict",
    "check_keys",
    "parse_bool",
    "rule_for",
]

TRUE_STRINGS: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_STRINGS: Final = frozenset({"0", "off", "f", "false", "n", "no"})


def parse_bool(value: object) -> bool | None:
    """``value`` as pydantic's lax bool (vLLM's configs), or ``None`` when it is not one."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Real) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in TRUE_STRINGS:
            return True
        if lowered in FALSE_STRINGS:
            return False
    return None


class Fate(enum.Enum):
    """What genworker does with a key (see the module docstring)."""

    HONOURED = "honoured"
    NEMO_RL_SIDE = "read by NeMo-RL, not by the worker"
    ASYNC_WORKER = "the async worker's key"
    HTTP_SERVER = "the HTTP server's key"
    REFUSED = "refused"


@attrs.frozen
class KeyRule:
    """One key's fate; ``note`` says what genworker does, or what to use instead."""

    key: str
    fate: Fate
    note: str
    inert: tuple[object, ...] = ()

    def accepts(self, value: object) -> bool:
        """Whether a config may carry ``value`` under this key."""
        if self.fate is not Fate.REFUSED:
            return True
        return any(_same(value, allowed) for allowed in self.inert)


def _same(value: object, allowed: object) -> bool:
    if isinstance(allowed, bool):
        return parse_bool(value) is allowed
    if allowed is None:
        return value is None
    if isinstance(allowed, int):
        return not isinstance(value, bool) and isinstance(value, int) and value == allowed
    if isinstance(allowed, list):
        return isinstance(value, list | tuple) and list(value) == allowed
    return type(value) is type(allowed) and value == allowed


_H, _N, _A, _S, _R = (
    Fate.HONOURED,
    Fate.NEMO_RL_SIDE,
    Fate.ASYNC_WORKER,
    Fate.HTTP_SERVER,
    Fate.REFUSED,
)
_FP8 = "genworker's fp8 plans only vLLM's block-fp8 kwargs (all layers fp8, no DeepGEMM)"
_SPARSE = "sparse-delta refit servers are not supported; use refit_transport: null"
_MM_BOTH = "; the same key in vllm_cfg too is a problem: keep one"

KEYS: Final[tuple[KeyRule, ...]] = (
    # GenerationConfig (nemo_rl/models/generation/interfaces.py)
    KeyRule("backend", _H, "must be 'vllm' (this worker is the vLLM backend)"),
    KeyRule("model_name", _H, "the model vLLM loads"),
    KeyRule("max_new_tokens", _H, "max_tokens of every request (then capped per row)"),
    KeyRule("temperature", _H, "sampling temperature (greedy=True forces 0)"),
    KeyRule("top_p", _H, "nucleus sampling"),
    KeyRule("top_k", _H, "top-k sampling; null or absent means off (-1)"),
    KeyRule("stop_token_ids", _H, "stop token ids of every request"),
    KeyRule("stop_strings", _H, "stop strings of every request (merged with per-row ones)"),
    KeyRule("bad_words", _H, "vLLM bad_words of every request"),
    KeyRule("ignore_eos", _H, "vLLM ignore_eos of every request"),
    KeyRule("_pad_token_id", _H, "the pad id of the padded output tensors"),
    KeyRule("vllm_cfg", _H, "the engine block (its keys below)"),
    KeyRule("vllm_kwargs", _H, "passed to vllm.LLM (reserved keys refused at load)"),
    KeyRule("val_temperature", _S, "NeMo-RL's on-policy guard of the OpenAI server"),
    KeyRule("val_top_p", _S, "NeMo-RL's on-policy guard of the OpenAI server"),
    KeyRule("val_top_k", _S, "NeMo-RL's on-policy guard of the OpenAI server"),
    KeyRule("port_range_low", _S, "the OpenAI server's port range"),
    KeyRule("port_range_high", _S, "the OpenAI server's port range"),
    KeyRule(
        "colocated.*",
        _N,
        "VllmGeneration's placement (PACK or shared GPUs) and NCCL settings; enabled must be "
        "a bool",
    ),
    KeyRule("use_async_rollouts", _N, "the sglang backend's switch"),
    KeyRule("mcore_generation_config.*", _N, "the megatron backend's block"),
    KeyRule("_debug_payload_metrics", _N, "VllmGeneration's payload logging"),
    KeyRule(
        "num_prompts_per_step",
        _N,
        "NeMo-RL's evaluation batch size (nemo_rl/evals/eval.py writes and reads it in the "
        "generation config)",
    ),
    KeyRule(
        "_mtp_weights_from_refit",
        _R,
        "genworker's refit never writes MTP drafter weights; leave it unset or false",
        inert=(False, None),
    ),
    # VllmConfig top level (nemo_rl/models/generation/vllm/config.py)
    KeyRule(
        "refit_transport",
        _R,
        "genworker serves IPC and collective refits (NeMo-RL's topology default); use null",
        inert=(None,),
    ),
    KeyRule("refit_cfg.*", _N, "tunes a refit_transport other than null, which is refused"),
    KeyRule(
        "checkpoint_engine",
        _R,
        "NeMo-RL replaced it by refit_transport: nixl, which genworker does not support",
        inert=(None,),
    ),
    KeyRule(
        "quant_cfg",
        _R,
        "ModelOpt quantized rollouts are not supported; use vllm_cfg.precision: fp8",
        inert=(None,),
    ),
    KeyRule(
        "real_quant",
        _R,
        "ModelOpt real-quant rollouts are not supported; use vllm_cfg.precision: fp8",
        inert=(False, None),
    ),
    KeyRule("real_quant_export_cpu_offload", _N, "read only with quant_cfg, which is refused"),
    KeyRule("real_quant_ignore", _N, "read only with quant_cfg, which is refused"),
    KeyRule(
        "nvfp4_pertoken_rollout",
        _R,
        "use vllm_cfg.nvfp4_per_token: true (vLLM's online per-token NVFP4)",
        inert=(None,),
    ),
    # genworker's own top-level keys
    KeyRule("seed", _H, "the engine seed when configure_worker gives none"),
    KeyRule("logprobs_mode", _H, "vLLM logprobs_mode (also accepted in vllm_cfg)"),
    KeyRule("telemetry.*", _H, "vLLM's OpenTelemetry tracing (genworker's block)"),
    # VllmSpecificArgs and the other vllm_cfg keys NeMo-RL reads
    KeyRule("vllm_cfg.tensor_parallel_size", _H, "vLLM tensor parallel size"),
    KeyRule("vllm_cfg.pipeline_parallel_size", _H, "vLLM pipeline parallel size"),
    KeyRule(
        "vllm_cfg.expert_parallel_size",
        _H,
        "enable_expert_parallel when > 1; at most tensor_parallel_size (EP > TP needs vLLM's "
        "internal data parallel, which genworker does not set up)",
    ),
    KeyRule(
        "vllm_cfg.enable_expert_parallel",
        _H,
        "derived from expert_parallel_size > 1, as NeMo-RL does; a value that contradicts "
        "it is refused",
    ),
    KeyRule(
        "vllm_cfg.distributed_executor_backend",
        _H,
        "the executor genworker starts ('ray' when tensor x pipeline parallel > 1, else "
        "'uni'); null or that value, anything else is refused",
    ),
    KeyRule("vllm_cfg.gpu_memory_utilization", _H, "vLLM gpu_memory_utilization"),
    KeyRule("vllm_cfg.max_model_len", _H, "vLLM max_model_len and the per-row caps"),
    KeyRule("vllm_cfg.skip_tokenizer_init", _H, "vLLM skip_tokenizer_init"),
    KeyRule("vllm_cfg.load_format", _H, "vLLM load_format"),
    KeyRule(
        "vllm_cfg.precision",
        _H,
        "vLLM dtype (aliases half, float, bf16, fp16, fp32); fp8 adds block-fp8 quantization",
    ),
    KeyRule("vllm_cfg.logprobs_mode", _H, "vLLM logprobs_mode"),
    KeyRule("vllm_cfg.cap_max_tokens_to_context", _H, "caps each row to the context left"),
    KeyRule("vllm_cfg.kv_cache_dtype", _H, "vLLM kv_cache_dtype"),
    KeyRule("vllm_cfg.enforce_eager", _H, "vLLM enforce_eager"),
    KeyRule("vllm_cfg.enable_prefix_caching", _H, "vLLM prefix caching (null: on for sm80+)"),
    KeyRule("vllm_cfg.use_tqdm", _H, "vLLM's progress bar in generate (genworker's default off)"),
    KeyRule(
        "vllm_cfg.env_vars.*",
        _H,
        "exported before the engine starts and forwarded to vLLM's Ray workers",
    ),
    KeyRule("vllm_cfg.speculative_config.*", _H, "vLLM speculative decoding (also in vllm_kwargs)"),
    KeyRule("vllm_cfg.sleep_level", _H, "genworker's default sleep level (1 or 2)"),
    KeyRule("vllm_cfg.nvfp4_per_token", _H, "vLLM's online per-token NVFP4 MoE quantization"),
    KeyRule(
        "vllm_cfg.limit_mm_per_prompt.*",
        _H,
        "vLLM limit_mm_per_prompt; the worker checks each row's images against it",
    ),
    KeyRule(
        "vllm_cfg.mm_processor_kwargs.*",
        _H,
        "vLLM mm_processor_kwargs (overrides for the model's Hugging Face processor)",
    ),
    KeyRule(
        "vllm_cfg.reset_encoder_cache_after_weight_update",
        _H,
        "true: the worker resets the encoder and multimodal caches after every refit; false: "
        "vacuous on a text-only model (no encoder cache), refused with a BadConfigError when "
        "the engine is multimodal (encoder outputs of the old weights would be stale)",
    ),
    KeyRule(
        "vllm_cfg.async_engine",
        _H,
        "picks the worker: false is VllmGenerationWorker (vllm.LLM), true "
        "AsyncVllmGenerationWorker (vllm AsyncLLM; GenerationGroup starts it); each refuses "
        "the other's value with a typed error naming the other class",
    ),
    KeyRule(
        "vllm_cfg.enable_vllm_metrics_logger",
        _A,
        "starts the async worker's metrics thread (get_vllm_logger_metrics); the sync "
        "worker, like NeMo-RL's, has none",
    ),
    KeyRule(
        "vllm_cfg.vllm_metrics_logger_interval",
        _A,
        "the async worker's metrics thread's period in seconds (default 0.5)",
    ),
    KeyRule("vllm_cfg.expose_http_server", _S, "starts vLLM's OpenAI server"),
    KeyRule("vllm_cfg.http_server_serving_chat_kwargs.*", _S, "the OpenAI chat endpoint"),
    KeyRule("vllm_cfg.tool_parser_plugin", _S, "the OpenAI server's tool parser"),
    KeyRule("vllm_cfg.reasoning_parser_plugin", _S, "the OpenAI server's reasoning parser"),
    KeyRule("vllm_cfg.http_server_host", _S, "genworker: the OpenAI server's listen address"),
    KeyRule("vllm_cfg.http_server_port", _S, "genworker: the OpenAI server's port (0: any)"),
    KeyRule(
        "vllm_cfg.http_server_on_policy_guard",
        _S,
        "genworker: refuse off-policy sampling parameters over HTTP (default true)",
    ),
    KeyRule("vllm_cfg.use_deep_gemm", _R, _FP8 + "; leave it false", inert=(False,)),
    KeyRule("vllm_cfg.num_first_layers_in_bf16", _R, _FP8 + "; leave it 0", inert=(0, None)),
    KeyRule("vllm_cfg.num_last_layers_in_bf16", _R, _FP8 + "; leave it 0", inert=(0, None)),
    KeyRule("vllm_cfg.pow2_weight_scaling_factors", _R, _FP8 + "; leave it false", inert=(False,)),
    KeyRule(
        "vllm_cfg.pow2_activation_scaling_factors",
        _R,
        _FP8 + "; leave it false",
        inert=(False,),
    ),
    KeyRule(
        "vllm_cfg.quantization_ignored_layer_kws",
        _R,
        _FP8 + "; list modules in vllm_kwargs.hf_overrides.quantization_config.ignored_layers",
        inert=(None, []),
    ),
    KeyRule(
        "vllm_cfg.is_mx", _R, "MXFP8 rollouts are not supported; use precision: fp8", inert=(False,)
    ),
    KeyRule(
        "vllm_cfg.refit_prequantize",
        _R,
        "trainer-side pre-quantization is not supported; prepare_refit_info returns None",
        inert=(False, None),
    ),
    KeyRule(
        "vllm_cfg.enable_return_routed_experts",
        _R,
        "routed experts (R3) are not returned by generate; leave it false",
        inert=(False,),
    ),
    KeyRule("vllm_cfg.http_refit_api_key_env_var", _R, _SPARSE, inert=(None,)),
    KeyRule("vllm_cfg.http_refit_server_port", _R, _SPARSE, inert=(None,)),
    KeyRule("vllm_cfg.zmq_refit_server_port", _R, _SPARSE, inert=(None,)),
    KeyRule(
        "vllm_cfg.video",
        _R,
        "video inputs are not supported (the worker takes images, through "
        "multi_modal_data); remove it",
    ),
    # vllm_kwargs entries genworker cannot pass through honestly
    KeyRule(
        "vllm_kwargs.enable_return_routed_experts",
        _R,
        "routed experts (R3) are not returned by generate; leave it false",
        inert=(False,),
    ),
    KeyRule(
        "vllm_kwargs.media_io_kwargs",
        _R,
        "the worker hands vLLM decoded PIL images; vLLM reads media_io_kwargs only for "
        "media it loads itself (URLs, bytes, video files); remove it",
    ),
    # vllm_kwargs entries for images, passed to vLLM as they are
    KeyRule("vllm_kwargs.limit_mm_per_prompt", _H, "vLLM limit_mm_per_prompt" + _MM_BOTH),
    KeyRule("vllm_kwargs.mm_processor_kwargs", _H, "vLLM mm_processor_kwargs" + _MM_BOTH),
    KeyRule(
        "vllm_kwargs.mm_processor_cache_gb",
        _H,
        "vLLM's processed-media cache size (the worker resets it after refits and before sleep)",
    ),
    KeyRule("vllm_kwargs.skip_mm_profiling", _H, "vLLM skips the multimodal memory profiling"),
)
"""The table: one rule per key NeMo-RL's generation config carries (and genworker's own)."""

_BY_KEY: Final = {rule.key: rule for rule in KEYS}


def rule_for(path: str) -> KeyRule | None:
    """The rule of a dotted key: its own, or the ``.*`` rule of the nearest block above it."""
    rule = _BY_KEY.get(path)
    if rule is not None:
        return rule
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        block = _BY_KEY.get(".".join(parts[:n]) + ".*")
        if block is not None:
            return block
    return _BY_KEY.get(path + ".*")


@attrs.frozen
class KeyVerdict:
    """A key the config may not carry (with this value), and why."""

    key: str
    message: str


def _verdict(path: str, value: object) -> KeyVerdict | None:
    rule = rule_for(path)
    if rule is None:
        return KeyVerdict(
            path,
            "unknown key: not a NeMo-RL generation-config key genworker knows (a typo, or a "
            "newer NeMo-RL key); remove it",
        )
    if rule.accepts(value):
        return None
    return KeyVerdict(path, f"{rule.fate.value}: {rule.note} (got {value!r})")


def check_keys(
    config: Mapping[str, object] | Mapping[object, object],
) -> tuple[KeyVerdict, ...]:
    """Every key of ``config`` (top level, ``vllm_cfg``, ``vllm_kwargs``) that the table
    refuses, in input order. Values are not otherwise checked here, and keys that are not
    strings are left to the parser, which names them."""
    out: list[KeyVerdict] = []
    for key, value in config.items():
        if not isinstance(key, str):
            continue
        verdict = _verdict(key, value)
        if verdict is not None:
            out.append(verdict)
    for block, every_key in (("vllm_cfg", True), ("vllm_kwargs", False)):
        inner = config.get(block)
        if not isinstance(inner, Mapping):
            continue
        for key, value in inner.items():
            if not isinstance(key, str):
                continue
            path = f"{block}.{key}"
            if not every_key and path not in _BY_KEY:
                continue  # vllm_kwargs goes to vLLM, which checks its own names
            verdict = _verdict(path, value)
            if verdict is not None:
                out.append(verdict)
    return tuple(out)
