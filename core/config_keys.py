"""Every key of NeMo-RL's generation config, and what genworker does with it: the table.

Theory of operation
-------------------
NeMo-RL hands its vLLM worker the ``policy.generation`` dict (``GenerationConfig`` in
``nemo_rl/models/generation/interfaces.py``, ``VllmConfig`` / ``VllmSpecificArgs`` in
``nemo_rl/models/generation/vllm/config.py``, read at NeMo-RL commit 7ea279ab). A key that
parses and then does nothing is a bug, so :data:`KEYS` gives each key one :class:`Fate`:

* ``HONOURED``: the worker does what the key says (``config.py`` parses it).
* ``INERT``: a key NeMo-RL's own configs carry that asks the worker for nothing it does not
  already do, accepted with the reason in its note; the parser still checks that its value
  agrees with the keys that do act (``dtype`` must name ``vllm_cfg.precision``;
  ``tokenizer.name``, when given, must be ``model_name``) and refuses a contradiction by name.
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
checked there.

Keys in no table (the unknown-key policy)
-----------------------------------------
A key with no rule here, at the top level or in ``vllm_cfg``, is a typo or a key of a
NeMo-RL release newer than this table. By default it is refused by name
(``unknown_keys: refuse``): a key that changes behaviour must never be dropped silently.
The one switch ``unknown_keys: warn`` (a top-level key of genworker's own) turns each such
refusal into a named warning instead: the config parses, the key is kept in the config's
``extras`` and has no effect, and the worker logs ``genworker ignores generation-config key
<path>: ...`` once per key when it starts (:attr:`~genworker.core.config.WorkerConfig.warnings`).
Keys this table refuses stay refused under either setting: the switch covers only keys
genworker has never seen. The drift rules at the end of :data:`KEYS` give a fate to every key
NeMo-RL added after 7ea279ab that genworker knows of (read from its pull requests).

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
    "UNKNOWN_KEY_POLICIES",
    "Fate",
    "KeyRule",
    "KeyVerdict",
    "check_keys",
    "parse_bool",
    "rule_for",
]

UNKNOWN_KEY_POLICIES: Final = ("refuse", "warn")
"""Values of ``unknown_keys`` (see the module docstring); the first is the default."""

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
    INERT = "accepted as inert"
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


_H, _I, _N, _A, _S, _R = (
    Fate.HONOURED,
    Fate.INERT,
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
    KeyRule(
        "stop_strings_mode",
        _H,
        "how per-row stop strings spread over a batch: 'per_sample' (the default: each row "
        "stops on the config's strings and its own) or 'batch_union' (NeMo-RL's sync "
        "generate: every row stops on every row's strings); the drop-ins pass it to the "
        "worker they build",
    ),
    KeyRule(
        "unknown_keys",
        _H,
        "what happens to a key in no table: 'refuse' (the default) or 'warn' (accepted, "
        "without effect, and logged by name when the worker starts)",
    ),
    # NeMo-RL's unit-test config (tests/unit/models/generation/test_vllm_generation.py
    # basic_vllm_test_config) carries these beside the generation keys
    KeyRule(
        "dtype",
        _I,
        "the engine's dtype is vllm_cfg.precision (NeMo-RL's worker reads that, not dtype); "
        "a dtype naming another precision is refused naming both",
    ),
    KeyRule(
        "tokenizer.*",
        _I,
        "NeMo-RL's tokenizer config (policy.tokenizer): the engine loads model_name's "
        "tokenizer, as NeMo-RL's worker does; a tokenizer.name other than model_name is "
        "refused (stop strings and texts would use another tokenizer)",
    ),
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
        "vllm_cfg.refit_finite_check",
        _H,
        "true (default): the engine refuses a refit holding NaN or inf before it counts (one "
        "fused reduction per chunk); false: the worker tells its engine workers to skip the "
        "check (docs/refit.md)",
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
    KeyRule(
        "vllm_cfg.http_server_rl_routes",
        _S,
        "genworker: vLLM's RL routes (pause, sleep, weight transfer) on the server (default false)",
    ),
    KeyRule(
        "vllm_cfg.http_server_weight_transfer_timeout_s",
        _S,
        "genworker: the bound of each wait of a weight transfer over those routes (default 300)",
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
        _H,
        "MoE routing replay: generate returns routed_experts (docs/r3.md)",
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
        _H,
        "NeMo-RL's switch for MoE routing replay (PR #2590): as vllm_cfg's",
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
    # LoRA (core/lora.py; NeMo-RL's native LoRA refit, nemo_rl/models/generation/vllm/
    # lora_utils.py): checked by core.lora.plan_lora, passed to vLLM, read by the adapter refit
    KeyRule(
        "lora_refit_mode", _H, "native: adapter-only refits (enables LoRA); merged: full refits"
    ),
    KeyRule("vllm_kwargs.enable_lora", _H, "vLLM's LoRA layers; adapter refits need it"),
    KeyRule("vllm_kwargs.max_lora_rank", _H, "the largest adapter rank; vLLM's values only"),
    KeyRule("vllm_kwargs.max_loras", _H, "adapters one batch may mix"),
    KeyRule("vllm_kwargs.max_cpu_loras", _H, "adapter names held at once (>= max_loras)"),
    KeyRule(
        "vllm_kwargs.lora_dtype", _H, "the adapters' dtype in the engine (auto, float16, bfloat16)"
    ),
    KeyRule(
        "vllm_kwargs.additional_config.*",
        _H,
        "passed to vLLM; nemo_rl_native_lora {rank, alpha} checked against max_lora_rank, its "
        "alpha the default of adapter refits",
    ),
    # Drift: keys NeMo-RL added after 7ea279ab (merged or open pull requests, 2026-08/09)
    KeyRule(
        "vllm_cfg.refit_with_reload_api",
        _R,
        "NeMo-RL #3651 installs refits through vLLM's reload_weights in its own worker "
        "extension; genworker's refit has its own receiver and choice of loader (shell/"
        "extension.py), which this key does not reach; leave it false",
        inert=(False, None),
    ),
    KeyRule(
        "vllm_cfg.quantization_ignore_patterns",
        _R,
        "NeMo-RL #3652's MXFP8/fp8 ignore patterns; "
        + _FP8
        + "; list modules in vllm_kwargs.hf_overrides.quantization_config.ignored_layers",
        inert=(None, []),
    ),
    KeyRule(
        "truncate_prompt_tokens",
        _R,
        "genworker never truncates prompts: a row that leaves no room under max_model_len is "
        "refused by name (vllm_cfg.cap_max_tokens_to_context caps the generated tokens "
        "instead); leave it null",
        inert=(None,),
    ),
    KeyRule(
        "_validation_generation",
        _R,
        "genworker does not switch a worker to validation sampling; build the validation "
        "worker from a config whose temperature/top_p/top_k are the val_* values",
        inert=(False, None),
    ),
    KeyRule(
        "vllm_cfg.reset_mm_cache_after_refit",
        _H,
        "NeMo-RL #3648's switch (written as 'is the model a VLM' when unset); read as "
        "reset_encoder_cache_after_weight_update is: true is what the worker does (it resets "
        "the multimodal and encoder caches after every refit), false is vacuous on a "
        "text-only engine and refused on a multimodal one",
    ),
    KeyRule(
        "deduplicate_multimodal_data",
        _R,
        "NeMo-RL #3534/#3818's packed media payloads (one image set for a prompt's "
        "generations) are not read; the worker takes one image list per row; leave it false",
        inert=(False, None),
    ),
    KeyRule(
        "vllm_cfg.use_torch_logprobs",
        _R,
        "genworker returns vLLM's own logprobs (logprobs_mode); it does not recompute them "
        "in torch; use vllm_cfg.logprobs_mode and leave it false",
        inert=(False, None),
    ),
    KeyRule(
        "router_url",
        _R,
        "NeMo-RL #3458/#3518 route rollouts through an external vLLM Router; genworker's "
        "drop-in serves NeMo-RL's rollouts through Ray calls (and NeMo-Gym through each "
        "worker's own OpenAI server); leave it null",
        inert=(None,),
    ),
    KeyRule(
        "router_request_id_header",
        _R,
        "read only with router_url (a vLLM Router), which is refused; leave it null",
        inert=(None,),
    ),
    KeyRule(
        "server_groups",
        _R,
        "vLLM Router server groups are not supported (no router_url); leave it null",
        inert=(None, [], {}),
    ),
    KeyRule(
        "real_quant_calibration_path",
        _R,
        "ModelOpt real-quant rollouts (NeMo-RL #3945) are not supported; use "
        "vllm_cfg.precision: fp8 and leave it null",
        inert=(None,),
    ),
    KeyRule(
        "_modelopt_quantization_config",
        _R,
        "ModelOpt real-quant rollouts (NeMo-RL #3945) are not supported; use "
        "vllm_cfg.precision: fp8 and leave it null",
        inert=(None,),
    ),
    KeyRule(
        "refit_prequantize",
        _R,
        "trainer-side pre-quantization is not supported; prepare_refit_info returns None",
        inert=(False, None),
    ),
    KeyRule(
        "refit_cache_loader_routes",
        _R,
        "genworker's refit has no per-route loader cache; leave it null",
        inert=(None, [], {}),
    ),
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
    #: the key has no rule (``unknown_keys: warn`` makes it a warning)
    unknown: bool = False


def _verdict(path: str, value: object) -> KeyVerdict | None:
    rule = rule_for(path)
    if rule is None:
        return KeyVerdict(
            path,
            "unknown key: not a NeMo-RL generation-config key genworker knows (a typo, or a "
            "newer NeMo-RL key); remove it, or set unknown_keys: warn to accept keys "
            "genworker has not seen (without effect, logged by name)",
            unknown=True,
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
