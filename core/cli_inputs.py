"""The inputs of ``genworker generate`` and ``serve``, checked before an engine starts.

Theory of operation
-------------------
The CLI (``shell/cli.py``) reads the prompts file and lets vLLM's own ``EngineArgs``
parser read the engine flags; everything it then decides is here, over those values:

* :func:`parse_prompts`: the JSONL lines (bytes, as read) to ``(line number, prompt)``;
  the first bad line is an :class:`InputProblem` naming the file and the line
  (:func:`unreadable_prompts`: a file that cannot be opened).
* :func:`worker_config`: genworker's NeMo-RL generation config for a local model, sized
  for the device (a CPU gets a 256-token context, float32 and a fixed 32 MiB KV cache).
* :func:`engine_config`: that config with the engine options put in
  (:data:`ENGINE_OPTION_KEYS`, else ``vllm_kwargs``), then checked as the worker checks
  it (``core.config``, ``core.engine_plan``): a problem is named by the flag that set its
  key, where a flag did.
* :func:`check_prompt_lengths`: each prompt leaves room for one generated token (the
  worker's rule, ``core.caps.context_cap``).
* :func:`serve_keys`: the ``vllm_cfg`` keys ``serve`` sets; :func:`completion_records`:
  the JSONL lines ``generate`` writes; :func:`log_environment`: the environment that sets
  vLLM's and transformers' logging to a level, :func:`log_level` the level a command
  chooses; :func:`check_options`: what argparse cannot check of a command's options.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
from returns.pipeline import is_successful
from returns.result import Failure, Result, Success

from genworker.core.caps import context_cap
from genworker.core.config import ConfigProblem, WorkerConfig
from genworker.core.engine_plan import plan_engine_kwargs
from genworker.core.errors import CoreError

__all__ = [
    "COUNT_OPTIONS",
    "ENGINE_OPTION_KEYS",
    "LOG_LEVELS",
    "InputProblem",
    "check_options",
    "check_prompt_lengths",
    "completion_records",
    "config_problems",
    "engine_config",
    "explain_problems",
    "log_environment",
    "log_level",
    "parse_prompts",
    "serve_keys",
    "unreadable_prompts",
    "worker_config",
]


@attrs.frozen
class InputProblem(CoreError):
    """A bad input of ``generate`` or ``serve`` (file, line, option); the message names it."""


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _prompt(where: str, raw: bytes) -> Result[str | None, InputProblem]:
    """The prompt of one JSONL line (None: a blank line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Failure(InputProblem(f"{where}: not UTF-8 text (byte {e.start + 1})"))
    if not line.strip():
        return Success(None)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return Failure(InputProblem(f"{where}: not valid JSON: {e.msg} at column {e.colno}"))
    if not isinstance(record, dict):
        return Failure(
            InputProblem(
                f'{where}: expected a JSON object {{"prompt": "..."}}, got {_json_type(record)}'
            )
        )
    if "prompt" not in record:
        keys = ", ".join(repr(k) for k in record) or "none"
        return Failure(InputProblem(f"{where}: no 'prompt' key (keys: {keys})"))
    prompt = record["prompt"]
    if not isinstance(prompt, str):
        return Failure(
            InputProblem(f"{where}: 'prompt' must be a string, got {_json_type(prompt)}")
        )
    if not prompt:
        return Failure(InputProblem(f"{where}: 'prompt' is empty"))
    return Success(prompt)


def unreadable_prompts(path: str, error: OSError) -> InputProblem:
    """The prompts file at ``path`` could not be opened (``error``): how."""
    if isinstance(error, FileNotFoundError):
        return InputProblem(f"--prompts {path}: no such file")
    if isinstance(error, IsADirectoryError):
        return InputProblem(f"--prompts {path}: a directory, not a JSONL file")
    return InputProblem(f"--prompts {path}: cannot be read: {error.strerror}")


def parse_prompts(
    path: str, raw_lines: Sequence[bytes]
) -> Result[list[tuple[int, str]], InputProblem]:
    """The prompts of the JSONL file ``path`` (its ``raw_lines``) with their line numbers,
    blank lines skipped; the first bad line, named ``path:line``, else a file without
    prompts."""
    prompts: list[tuple[int, str]] = []
    for n, raw in enumerate(raw_lines, 1):
        match _prompt(f"{path}:{n}", raw):
            case Failure(problem):
                return Failure(problem)
            case Success(str() as prompt):
                prompts.append((n, prompt))
    if not prompts:
        what = "empty" if not raw_lines else "blank lines only"
        return Failure(InputProblem(f"{path}:{len(raw_lines) or 1}: no prompts ({what})"))
    return Success(prompts)


def check_prompt_lengths(
    path: str,
    lines: Sequence[int],
    lengths: Sequence[int],
    *,
    max_model_len: int,
    max_new_tokens: int,
) -> Result[None, InputProblem]:
    """Each prompt leaves room for a generated token in the context (the worker's rule,
    ``core.caps.context_cap``); else the first line that does not."""
    for line, length in zip(lines, lengths, strict=True):
        if not is_successful(context_cap(max_new_tokens, length, max_model_len)):
            return Failure(
                InputProblem(
                    f"{path}:{line}: the prompt is {length} tokens, longer than the context "
                    f"leaves room for (--max-model-len {max_model_len}: at most "
                    f"{max_model_len - 1} prompt tokens, one left to generate)"
                )
            )
    return Success(None)


def worker_config(
    model: str,
    *,
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float,
    device: str,
    load_progress: bool = True,
) -> dict[str, object]:
    """A NeMo-RL generation config for ``model`` on ``device`` (``load_progress``: vLLM's
    bar while it loads the checkpoint)."""
    on_cpu = device == "cpu"
    kwargs: dict[str, object] = {"use_tqdm_on_load": False} if not load_progress else {}
    if on_cpu:
        # vLLM sizes the CPU KV cache from the NUMA node's memory minus the process's,
        # which can go negative on a small machine: ask for a fixed 32 MiB instead.
        kwargs["kv_cache_memory_bytes"] = 32 << 20
    return {
        "backend": "vllm",
        "model_name": model,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "_pad_token_id": pad_token_id,
        "seed": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05 if on_cpu else 0.6,
            "max_model_len": 256 if on_cpu else 4096,
            "precision": "float32" if on_cpu else "bfloat16",
            "enforce_eager": on_cpu,
            "cap_max_tokens_to_context": True,
        },
        "vllm_kwargs": kwargs,
    }


ENGINE_OPTION_KEYS: Final[Mapping[str, str]] = {
    "max_model_len": "vllm_cfg.max_model_len",
    "tensor_parallel_size": "vllm_cfg.tensor_parallel_size",
    "pipeline_parallel_size": "vllm_cfg.pipeline_parallel_size",
    "gpu_memory_utilization": "vllm_cfg.gpu_memory_utilization",
    "dtype": "vllm_cfg.precision",
    "enforce_eager": "vllm_cfg.enforce_eager",
    "load_format": "vllm_cfg.load_format",
    "kv_cache_dtype": "vllm_cfg.kv_cache_dtype",
    "enable_prefix_caching": "vllm_cfg.enable_prefix_caching",
    "skip_tokenizer_init": "vllm_cfg.skip_tokenizer_init",
    "logprobs_mode": "vllm_cfg.logprobs_mode",
    "limit_mm_per_prompt": "vllm_cfg.limit_mm_per_prompt",
    "mm_processor_kwargs": "vllm_cfg.mm_processor_kwargs",
    "speculative_config": "vllm_cfg.speculative_config",
    "distributed_executor_backend": "vllm_cfg.distributed_executor_backend",
    "enable_expert_parallel": "vllm_cfg.enable_expert_parallel",
    "seed": "seed",
}
"""vLLM engine options (``EngineArgs`` field names) that genworker's config holds under its
own key; every other option goes to ``vllm_kwargs`` under its own name. Either way the
worker's checks and its engine-kwargs plan apply: an option genworker refuses is refused
by name before the engine starts."""


def config_problems(config: Mapping[str, object]) -> tuple[ConfigProblem, ...]:
    """What the worker would refuse in ``config`` before starting an engine: its parse
    and its engine-kwargs plan (``core.config``, ``core.engine_plan``)."""
    parsed = WorkerConfig.from_mapping(config)
    if not is_successful(parsed):
        return parsed.failure().problems
    plan = plan_engine_kwargs(
        parsed.unwrap(), seed=0, gpu_capability=None, extension_cls="genworker"
    )
    return () if is_successful(plan) else plan.failure().problems


def explain_problems(problems: Sequence[ConfigProblem], flags: Mapping[str, str]) -> str:
    """``problems`` named by the flag that set their key (``flags``: config key to flag),
    where a flag did."""

    def flag_of(key: str) -> str | None:
        owners = [path for path in flags if key == path or key.startswith(path + ".")]
        return flags[max(owners, key=len)] if owners else None

    lines = []
    for problem in problems:
        flag = flag_of(problem.key)
        lines.append(f"{flag} ({problem})" if flag else str(problem))
    return "; ".join(lines)


def engine_config(
    base: Mapping[str, object],
    options: Mapping[str, object],
    vllm_cfg: Mapping[str, object] | None = None,
) -> Result[dict[str, object], InputProblem]:
    """``base`` (a :func:`worker_config`) with the engine ``options`` put in
    (:data:`ENGINE_OPTION_KEYS`, else ``vllm_kwargs``), then ``vllm_cfg``'s keys (the
    command's own); refused by flag where the worker would refuse it."""
    sections: dict[str, dict[str, object]] = {}
    for name in ("vllm_cfg", "vllm_kwargs"):
        section = base[name]
        assert isinstance(section, Mapping)
        sections[name] = dict(section)
    config: dict[str, object] = {**base, **sections}
    flags: dict[str, str] = {}
    for dest, value in options.items():
        path = ENGINE_OPTION_KEYS.get(dest, f"vllm_kwargs.{dest}")
        section_name, _, key = path.rpartition(".")
        (sections[section_name] if section_name else config)[key] = value
        flags[path] = "--" + dest.replace("_", "-")
    sections["vllm_cfg"].update(vllm_cfg or {})
    problems = config_problems(config)
    if problems:
        return Failure(InputProblem(explain_problems(problems, flags)))
    return Success(config)


def serve_keys(
    host: str, port: int, *, on_policy_guard: bool, rl_routes: bool, chat_template: str | None
) -> dict[str, object]:
    """The ``vllm_cfg`` keys of ``serve``: the async worker with its OpenAI server on
    ``host``:``port``, its on-policy guard, vLLM's RL routes, and the chat template's text
    where ``--chat-template`` gave one."""
    keys: dict[str, object] = {
        "async_engine": True,
        "expose_http_server": True,
        "http_server_host": host,
        "http_server_port": port,
        "http_server_on_policy_guard": on_policy_guard,
        "http_server_rl_routes": rl_routes,
    }
    if chat_template is not None:
        keys["http_server_serving_chat_kwargs"] = {"chat_template": chat_template}
    return keys


def completion_records(
    prompts: Sequence[str],
    completions: Sequence[str],
    prompt_tokens: Sequence[int],
    generated_tokens: Sequence[int],
    truncated: Sequence[bool],
) -> list[str]:
    """``generate``'s JSONL lines for a chunk of prompts, one per prompt, in order."""
    rows = zip(prompts, completions, prompt_tokens, generated_tokens, truncated, strict=True)
    return [
        json.dumps(
            {
                "prompt": prompt,
                "completion": text,
                "prompt_tokens": tokens,
                "generated_tokens": generated,
                "truncated": cut,
            }
        )
        + "\n"
        for prompt, text, tokens, generated, cut in rows
    ]


def log_environment(level: str) -> dict[str, str]:
    """The environment that sends vLLM's log lines to stderr from ``level`` on, sets
    transformers' verbosity, and from ``warning`` on turns the Hub's progress bars (and
    transformers', which follow them) off."""
    env = {
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        "VLLM_LOGGING_LEVEL": level.upper(),
        "TRANSFORMERS_VERBOSITY": level,
    }
    if level in ("warning", "error"):
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return env


#: The levels of ``--log-level`` and ``VLLM_LOGGING_LEVEL``, from the most lines.
LOG_LEVELS: Final = ("debug", "info", "warning", "error")


def log_level(quiet: bool, level: str | None, inherited: str) -> Result[str, InputProblem]:
    """The level a command logs at: ``error`` when ``quiet``, else ``--log-level``'s
    ``level``, else ``inherited`` (``VLLM_LOGGING_LEVEL`` where set, else the command's
    default) in lower case; one of :data:`LOG_LEVELS`."""
    chosen = "error" if quiet else (level or inherited.lower())
    if chosen not in LOG_LEVELS:
        expected = ", ".join(LOG_LEVELS)
        return Failure(InputProblem(f"VLLM_LOGGING_LEVEL={chosen!r}: expected one of {expected}"))
    return Success(chosen)


#: The options that count something (new tokens, rows per call, the demo's batches,
#: steps, samples and shards): where given, at least 1.
COUNT_OPTIONS: Final = ("max_new_tokens", "chunk", "batch", "steps", "samples", "shards")


def check_options(
    quiet: bool, level: str | None, counts: Mapping[str, int | None]
) -> Result[None, InputProblem]:
    """What argparse cannot check of a command's options: ``-q`` and ``--log-level`` not
    both given, and each of :data:`COUNT_OPTIONS` given (``counts``) at least 1."""
    if quiet and level is not None:
        return Failure(
            InputProblem("-q or --log-level: -q means --log-level error and no progress bar")
        )
    for name, value in counts.items():
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            return Failure(InputProblem(f"{flag} must be at least 1, got {value}"))
    return Success(None)
