"""The OpenAI server's decisions: its options, the on-policy guard, the token budget of
one request, the multi-turn prefix, and the weight versions a response reports.

Theory of operation
-------------------
The shell (``genworker.shell.server``) puts a thin ASGI layer in front of vLLM's own OpenAI
app (``build_app`` + ``init_app_state``, vLLM 0.25 / 0.32); every decision that layer takes
is a pure function here, so it can be stated as a law and tested without a server.

- **Options** (:func:`server_options`): NeMo-RL's ``vllm_cfg.expose_http_server: true``
  turns the server on. genworker's own keys, all optional: ``http_server_host`` (default
  ``127.0.0.1``: loopback; any other address is the caller's explicit choice, and the
  shell logs it), ``http_server_port`` (default 0: any free port, bound before the engine
  loads), ``http_server_on_policy_guard`` (default true) and NeMo-RL's
  ``http_server_serving_chat_kwargs``, of which ``chat_template`` is honoured and any other
  key refused (NeMo-RL's ``tool_parser_plugin`` / ``reasoning_parser_plugin`` likewise: a
  key that parses and does nothing is a bug).
- **On-policy guard** (:func:`check_on_policy`): the trainer learns on the logprobs of the
  distribution it configured, so a request may not sample from another one. For every
  parameter of :func:`training_policy` a request either leaves it out (the training value
  is filled in: vLLM would otherwise take the model's ``generation_config.json`` defaults,
  ``OpenAIServing._get_default_sampling_params``) or gives the training value; anything
  else is refused naming the parameter. ``top_k`` 0 and -1 both mean "off" (vLLM's
  ``SamplingParams``); ``None`` means "left out" everywhere.
- **Token budget** (:func:`http_max_tokens`): the request's ``max_tokens`` (or the
  training ``max_new_tokens`` when it gives none) goes through ``core.caps``, the same caps
  as ``generate``. With ``cap_max_tokens_to_context`` (and always with speculative
  decoding) it is clamped to the room left in the context; without, a request whose
  prompt plus ``max_tokens`` passes ``max_model_len`` is refused naming ``max_tokens``. A
  prompt that leaves no room at all is refused either way.
- **Multi-turn prefix** (:func:`check_turns`, :func:`splice_prefix`): an agent sends the
  history back as text; each assistant message it got from this server may carry the ids
  that came back with it (NeMo Gym's ``prompt_token_ids`` / ``generation_token_ids``, or
  NeMo-RL's top-level ``required_prefix_token_ids``). The last turn's prompt + completion
  ids are the *reference*: the new prompt is the reference verbatim followed by the
  template's tokens for what came after it. Checks, each naming the message: a turn's
  content is the text of its generation ids; a turn's prompt ids start with the previous
  turn's reference; the text of the rendered conversation starts with the reference's
  text. The template's token at which that text ends is found by decoding (NeMo-RL's
  ``_maybe_correct_merged_tokens``); a reference whose text ends inside one of the
  template's tokens is refused rather than guessed. A turn's text may lack the trailing
  partial character vLLM's detokenizer drops (:func:`same_returned_text`); a template
  that is not prefix-stable is named in the refusal (:func:`check_template_stable`),
  never the caller's history.
- **Request bodies** (:func:`parse_body`, :func:`check_nesting`, :class:`HttpLimits`): a body is refused
  before it is parsed when it passes :attr:`HttpLimits.max_body_bytes`, and when
  parsed JSON nests deeper than :data:`MAX_JSON_DEPTH` (Python's ``json`` recurses: 100k
  levels are a ``RecursionError``, not a ``ValueError``). Both bounds are generous
  constants, not config keys: the depth of a real request (a tool's JSON schema
  included) is a few tens, and the byte bound is derived from ``max_model_len``
  (:func:`http_limits`: :data:`BODY_BYTES_FLOOR` for images and small contexts plus
  :data:`BODY_BYTES_PER_TOKEN` per context token, room for a whole text prompt at the
  character bound below even if every character is ``\\u``-escaped, or for tens of
  multi-turn id lists of the whole context). Malformed JSON is not refused here: vLLM
  answers it itself.
- **Prompts** (:func:`check_completion_prompt`, :func:`check_token_ids`,
  :func:`check_chat_text`): token ids are ints (a JSON ``true`` is not a token id),
  inside the vocabulary ``[0, vocab_size)`` (vLLM's ``BaseRenderer.validate_token_ids``,
  0.32, takes the larger of the tokenizer's and the model's vocabulary; so does the
  shell) and checked before anything decodes them (the tokenizer's ``decode`` overflows
  past ``2**63``); a prompt is never empty; a text prompt (or a chat request's text, all
  messages together) longer than :data:`CHARS_PER_TOKEN_AT_MOST` characters per context
  token is refused before it is tokenized: no tokenizer makes a real text average more
  than a few characters per token (English about 4, code about 3, CJK under 2; only long
  runs of one character come near 32), so such a prompt cannot fit ``max_model_len``,
  and tokenizing megabytes to find that out costs seconds of CPU and a lasting gigabyte
  of the server's memory. Each refusal names the request's field and, for an id, its
  index.
- **Routed experts** (:func:`check_routes_request`, :func:`drop_routes`): an MoE
  engine that captures (``enable_return_routed_experts``) makes vLLM add every choice's
  routes to a non-streamed response, a base64 ``.npy`` of ``prompt + generated - 1``
  rows; they are the request's to ask for (``return_routed_experts: true``), dropped
  otherwise, and refused, naming the field, where the engine does not capture or the
  request streams.
- **Versions** (:func:`versions_between`): the server reads the worker's weight version
  when a request arrives and when its response starts (non-streaming: the generation is
  complete) or when each streamed event passes; a version increases by one per refit, so
  the request was sampled under the versions in between, both included. This is a
  superset of its tokens' versions: a request that finished on the old weights while the
  refit's transfer ran may report both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

import attrs
from returns.result import Failure, Result, Success

from genworker.core.caps import CapError, CapFailure, request_max_tokens
from genworker.core.config import ConfigError, ConfigProblem, WorkerConfig
from genworker.core.config_keys import parse_bool
from genworker.core.errors import CoreError

__all__ = [
    "BODY_BYTES_FLOOR",
    "BODY_BYTES_PER_TOKEN",
    "CHARS_PER_TOKEN_AT_MOST",
    "DEFAULT_HOST",
    "DEV_MODE_VARIABLE",
    "MAX_JSON_DEPTH",
    "REPLACEMENT_CHARACTER",
    "ROUTES_CHOICE_FIELD",
    "ROUTES_FIELD",
    "TURN_FIELDS",
    "BadRequest",
    "Budget",
    "BudgetError",
    "ChatReference",
    "HttpLimits",
    "MalformedBody",
    "OffPolicy",
    "PrefixMismatch",
    "SamplingPolicy",
    "ServerOptions",
    "Turn",
    "chat_reference",
    "check_body_length",
    "check_chat_text",
    "check_completion_prompt",
    "check_dev_mode",
    "check_nesting",
    "check_on_policy",
    "check_routes_request",
    "check_template_stable",
    "check_token_ids",
    "check_turns",
    "drop_routes",
    "error_body",
    "http_limits",
    "http_max_tokens",
    "json_depth",
    "metrics_logger_interval",
    "parse_body",
    "prompt_tokens_at_most",
    "request_budget",
    "rollout_fills",
    "same_returned_text",
    "server_options",
    "splice_prefix",
    "split_events",
    "tag_events",
    "template_source",
    "tokenize_answer",
    "training_policy",
    "versions_between",
    "vllm_server_argv",
]

DEFAULT_HOST: Final = "127.0.0.1"
_SERVER_KEYS: Final = (
    "http_server_host",
    "http_server_port",
    "http_server_on_policy_guard",
    "http_server_serving_chat_kwargs",
    "http_server_rl_routes",
    "http_server_weight_transfer_timeout_s",
)
_REFUSED_KEYS: Final = ("tool_parser_plugin", "reasoning_parser_plugin")
_CHAT_KWARGS: Final = frozenset({"chat_template"})


# --- options ---------------------------------------------------------------------------


@attrs.frozen
class ServerOptions:
    """Where the server listens and how strict it is (see the module docstring)."""

    host: str = DEFAULT_HOST
    port: int = attrs.field(
        default=0,
        validator=attrs.validators.and_(attrs.validators.ge(0), attrs.validators.le(65535)),
    )
    on_policy_guard: bool = True
    chat_template: str | None = None
    #: vLLM's RL routes (pause, sleep, weight transfer; ``core.control_plane``)
    rl_routes: bool = False
    #: the bound of every wait of a weight transfer through those routes (the join, each
    #: packed buffer), seconds
    weight_transfer_timeout_s: float = 300.0

    @property
    def loopback(self) -> bool:
        """Whether only this host can connect."""
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")


def _problem(key: str, message: str) -> Failure[ConfigError]:
    return Failure(ConfigError.from_problems([ConfigProblem(f"vllm_cfg.{key}", message)]))


#: NeMo-RL's default ``vllm_cfg.vllm_metrics_logger_interval``, seconds
_LOGGER_INTERVAL_S: Final = 0.5


def _refused(key: str, message: str) -> Failure[ConfigError]:
    """``vllm_cfg.<key> <message>`` as the whole message."""
    full = f"vllm_cfg.{key} {message}"
    return Failure(ConfigError(full, problems=(ConfigProblem(f"vllm_cfg.{key}", message),)))


def metrics_logger_interval(cfg: WorkerConfig) -> Result[float | None, ConfigError]:
    """``vllm_cfg.enable_vllm_metrics_logger`` / ``vllm_metrics_logger_interval`` (the
    async worker's metrics thread, as NeMo-RL's): its period in seconds, or None when it
    is off."""
    extras = cfg.vllm.extras
    raw = extras.get("enable_vllm_metrics_logger", False)
    enabled = parse_bool(raw)
    if enabled is None:
        return _refused("enable_vllm_metrics_logger", f"must be a bool, got {raw!r}")
    interval = extras.get("vllm_metrics_logger_interval", _LOGGER_INTERVAL_S)
    if (
        isinstance(interval, bool)
        or not isinstance(interval, int | float)
        or not (math.isfinite(interval) and interval > 0)
    ):
        return _refused(
            "vllm_metrics_logger_interval",
            f"must be a finite number of seconds > 0, got {interval!r}",
        )
    return Success(float(interval) if enabled else None)


def server_options(cfg: WorkerConfig) -> Result[ServerOptions | None, ConfigError]:
    """The server's options, or ``None`` when ``expose_http_server`` is off or absent."""
    extras = cfg.vllm.extras
    raw_expose = extras.get("expose_http_server", False)
    expose = False if raw_expose is None else parse_bool(raw_expose)
    if expose is None:
        return _problem("expose_http_server", f"must be a bool, got {raw_expose!r}")
    given = [k for k in (*_SERVER_KEYS, *_REFUSED_KEYS) if extras.get(k) is not None]
    if not expose:
        if given:
            return _problem(given[0], "is set but expose_http_server is not true")
        return Success(None)
    for key in _REFUSED_KEYS:
        if extras.get(key) is not None:
            return _problem(key, "is not supported by genworker's server; leave it unset")
    host = extras.get("http_server_host", DEFAULT_HOST)
    if host is None:
        host = DEFAULT_HOST
    if not isinstance(host, str) or not host:
        return _problem("http_server_host", f"must be a non-empty str, got {host!r}")
    port = extras.get("http_server_port", 0)
    if port is None:
        port = 0
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        return _problem("http_server_port", f"must be an int in [0, 65535], got {port!r}")
    raw_guard = extras.get("http_server_on_policy_guard", True)
    guard = True if raw_guard is None else parse_bool(raw_guard)
    if guard is None:
        return _problem("http_server_on_policy_guard", f"must be a bool, got {raw_guard!r}")
    chat = extras.get("http_server_serving_chat_kwargs") or {}
    if not isinstance(chat, Mapping):
        return _problem("http_server_serving_chat_kwargs", f"must be a mapping, got {chat!r}")
    unknown = sorted(str(k) for k in chat if k not in _CHAT_KWARGS)
    if unknown:
        return _problem(
            "http_server_serving_chat_kwargs",
            f"keys {unknown} are not supported; only {sorted(_CHAT_KWARGS)}",
        )
    template = chat.get("chat_template")
    if template is not None and not isinstance(template, str):
        return _problem(
            "http_server_serving_chat_kwargs", f"chat_template must be a str, got {template!r}"
        )
    raw_rl = extras.get("http_server_rl_routes", False)
    rl_routes = False if raw_rl is None else parse_bool(raw_rl)
    if rl_routes is None:
        return _problem("http_server_rl_routes", f"must be a bool, got {raw_rl!r}")
    timeout = extras.get("http_server_weight_transfer_timeout_s", 300.0)
    timeout = 300.0 if timeout is None else timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < 1e6:
        return _problem(
            "http_server_weight_transfer_timeout_s",
            f"must be a number of seconds in (0, 1e6), got {timeout!r}",
        )
    return Success(ServerOptions(host, port, guard, template, rl_routes, float(timeout)))


DEV_MODE_VARIABLE: Final = "VLLM_SERVER_DEV_MODE"


def check_dev_mode(raw: str, dev_mode: bool = False) -> Result[None, ConfigError]:
    """Refused when vLLM would add its development routes: with ``VLLM_SERVER_DEV_MODE``
    on (``raw`` its value; ``dev_mode`` vLLM's own reading of it), vLLM's ``build_app``
    registers its own pause, sleep, ``collective_rpc`` and weight-update routes
    (``launchers/api_server/routers.py``, 0.32), which would move the engine behind
    genworker's lifecycle table, manifest checks and weight versions."""
    if dev_mode or raw.strip() not in ("", "0"):
        return Failure(
            ConfigError(
                f"{DEV_MODE_VARIABLE}={raw!r} is set: vLLM would then serve its own pause, "
                "sleep and weight-update routes around genworker's lifecycle and weight "
                f"versions. Unset {DEV_MODE_VARIABLE} (genworker's server refuses to start "
                "with it)"
            )
        )
    return Success(None)


def vllm_server_argv(
    model: str, max_model_len: int, served: str | Sequence[str] | None, chat_template: str | None
) -> list[str]:
    """The command line vLLM's own argument parser reads for the app around an engine of
    ``model`` (``served``: its served model names; ``chat_template``: the server's)."""
    argv = ["--model", model, "--max-model-len", str(max_model_len)]
    names = [served] if isinstance(served, str) else list(served or [])
    if names:
        argv += ["--served-model-name", *names]
    if chat_template is not None:
        argv += ["--chat-template", chat_template]
    return argv


# --- on-policy guard -------------------------------------------------------------------


@attrs.frozen
class OffPolicy(CoreError):
    """A request asks to sample from another distribution than the training config's."""

    parameter: str
    requested: object
    training: object


@attrs.frozen
class SamplingPolicy:
    """The sampling parameters a request must keep: ``{name: training value}``; a
    parameter whose training value is ``None`` must be left out (or ``None``/empty)."""

    values: tuple[tuple[str, object], ...]


def training_policy(cfg: WorkerConfig) -> SamplingPolicy:
    """The training config's sampling distribution, as OpenAI/vLLM request fields."""
    return SamplingPolicy(
        (
            ("temperature", cfg.temperature),
            ("top_p", cfg.top_p),
            ("top_k", cfg.top_k),
            ("min_p", 0.0),
            ("repetition_penalty", 1.0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("min_tokens", 0),
            ("bad_words", list(cfg.bad_words) or None),
            ("logit_bias", None),
            ("allowed_token_ids", None),
            ("use_beam_search", False),
            ("structured_outputs", None),
            ("guided_json", None),
            ("guided_regex", None),
            ("guided_choice", None),
            ("guided_grammar", None),
            ("logits_processors", None),
        )
    )


def _same(name: str, requested: object, training: object) -> bool:
    if name == "top_k" and isinstance(requested, int) and not isinstance(requested, bool):
        requested = -1 if requested == 0 else requested
    if training is None:
        return requested in (None, [], {}, "") or requested is False
    if isinstance(training, bool) or isinstance(requested, bool):
        return requested is training
    if isinstance(training, int | float):
        if not isinstance(requested, int | float):
            return False
        return float(requested) == float(training)
    return requested == training


def check_on_policy(
    body: Mapping[str, object], policy: SamplingPolicy
) -> Result[dict[str, object], OffPolicy]:
    """The fields to fill in (parameters left out), or the first parameter off policy.

    ``response_format`` may only be ``{"type": "text"}`` (structured output masks tokens).
    """
    fills: dict[str, object] = {}
    for name, training in policy.values:
        requested = body.get(name)
        if requested is None:
            if training is not None:
                fills[name] = training
            continue
        if not _same(name, requested, training):
            return Failure(
                OffPolicy(
                    f"sampling parameter {name}={requested!r} differs from the training "
                    f"config ({name}={training!r}); the on-policy guard refuses it",
                    parameter=name,
                    requested=requested,
                    training=training,
                )
            )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        return Failure(
            OffPolicy(
                f"response_format={fmt!r} constrains sampling; the on-policy guard refuses it",
                parameter="response_format",
                requested=fmt,
                training=None,
            )
        )
    return Success(fills)


def rollout_fills(
    body: Mapping[str, object], policy: SamplingPolicy | None, *, chat: bool
) -> Result[dict[str, object], OffPolicy]:
    """What a completion or chat request gets filled in (:func:`check_on_policy`'s
    training values when the guard is on; ``return_token_ids``; the sampled tokens'
    logprobs), or the first parameter off policy."""
    fills: dict[str, object] = {}
    if policy is not None:
        checked = check_on_policy(body, policy)
        if isinstance(checked, Failure):
            return checked
        fills.update(checked.unwrap())
    if body.get("return_token_ids") is not True:
        fills["return_token_ids"] = True
    if chat and not body.get("logprobs"):
        fills["logprobs"] = True
    elif not chat and body.get("logprobs") is None:
        fills["logprobs"] = 0
    return Success(fills)


# --- token budget ----------------------------------------------------------------------


@attrs.frozen
class BudgetError(CoreError):
    """``max_tokens`` is not a positive int, or passes the context (no clamping)."""

    requested: object
    room: int


def http_max_tokens(
    requested: object,
    prompt_length: int,
    *,
    max_new_tokens: int,
    max_model_len: int,
    cap_to_context: bool,
    num_speculative_tokens: int,
) -> Result[int, BudgetError | CapFailure]:
    """The ``max_tokens`` one HTTP request runs with (see the module docstring)."""
    room = max_model_len - prompt_length
    if room < 1:
        return Failure(
            CapError(
                f"the prompt ({prompt_length} tokens) leaves no room to generate; it must be "
                f"shorter than max_model_len {max_model_len}",
                rows=(0,),
                input_lengths=(prompt_length,),
                max_model_len=max_model_len,
                reserve=0,
            )
        )
    if requested is None:
        wanted = max_new_tokens
    elif isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        return Failure(
            BudgetError(
                f"max_tokens must be a positive int, got {requested!r}",
                requested=requested,
                room=room,
            )
        )
    else:
        wanted = requested
    capped = request_max_tokens(
        wanted,
        prompt_length,
        max_model_len,
        cap_to_context=cap_to_context,
        num_speculative_tokens=num_speculative_tokens,
    )
    if isinstance(capped, Failure):
        return capped
    tokens = capped.unwrap()
    if requested is not None and prompt_length + tokens > max_model_len:
        return Failure(
            BudgetError(
                f"max_tokens={requested} passes the context: the prompt has {prompt_length} "
                f"tokens and max_model_len is {max_model_len}, so at most {room} fit "
                "(vllm_cfg.cap_max_tokens_to_context: true clamps instead)",
                requested=requested,
                room=room,
            )
        )
    return Success(min(tokens, room))


Budget = Callable[[object, int], Result[int, BudgetError | CapFailure]]
""":func:`http_max_tokens` for one server's settings: ``(requested, prompt length)``."""


def request_budget(
    requested: object,
    prompt_lengths: Sequence[int],
    budget: Budget,
    *,
    key: str,
    prompt_param: str,
) -> Result[int, BadRequest]:
    """The ``max_tokens`` (the request's field ``key``) a request with prompts of
    ``prompt_lengths`` runs with: the least of their budgets, or a refusal naming the
    prompt (``prompt_param``: no room left) or ``key``."""
    budgets = []
    for length in prompt_lengths:
        found = budget(requested, length)
        if isinstance(found, Failure):
            problem = found.failure()
            param = prompt_param if isinstance(problem, CapError) else key
            return _bad(f"{param}: {problem}", param)
        budgets.append(found.unwrap())
    return Success(min(budgets))


def prompt_tokens_at_most(num_bytes: int) -> int:
    """An upper bound on the tokens of a text prompt of ``num_bytes`` UTF-8 bytes, for the
    budget's fast path: every token of the text covers at least one of its bytes (byte-level
    BPE, SentencePiece with byte fallback), plus the special tokens the tokenizer adds
    (BOS, a dummy-prefix piece); doubled, plus 16, for margin. The caps only shrink as the
    prompt grows, so a ``max_tokens`` that fits with this bound fits with the exact count
    and the prompt need not be tokenized."""
    return 2 * num_bytes + 16


# --- multi-turn prefix -----------------------------------------------------------------


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen
class Turn:
    """An earlier assistant turn as the agent sent it back: its place in ``messages``,
    its text, and the ids this server returned with it."""

    message: int
    content: str
    prompt_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    generation_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)

    @property
    def reference(self) -> tuple[int, ...]:
        """The ids of everything up to the end of this turn."""
        return self.prompt_ids + self.generation_ids


@attrs.frozen
class PrefixMismatch(CoreError):
    """The text of a request and the ids it carries disagree at ``messages[message]``."""

    message_index: int


REPLACEMENT_CHARACTER: Final = "\ufffd"
"""What a tokenizer's ``decode`` gives for bytes that are not whole UTF-8 characters."""


def same_returned_text(decoded: str, content: str) -> bool:
    """Whether ``content`` is the text the server returned for ids that decode to
    ``decoded``. vLLM's incremental detokenizer holds back a character whose UTF-8 bytes
    are not all there yet and drops it when the generation ends inside it
    (``vllm/v1/engine/detokenizer.py``, 0.32), where a whole decode gives U+FFFD for
    those bytes: the two agree up to trailing replacement characters."""
    if decoded == content:
        return True
    return decoded.rstrip(REPLACEMENT_CHARACTER) == content.rstrip(REPLACEMENT_CHARACTER)


TURN_FIELDS: Final = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""A chat message's fields that carry its turn's ids (NeMo Gym's), removed before vLLM."""


@attrs.frozen
class ChatReference:
    """The ids a chat request's new prompt must start with (empty: none), and the message
    they end at (named in a refusal)."""

    ids: tuple[int, ...]
    message: int


def chat_reference(
    messages: Sequence[Mapping[str, object]],
    required: object,
    vocab_size: int,
    decode_text: Callable[[Sequence[int]], str],
) -> Result[ChatReference, BadRequest]:
    """The reference of a chat request (the module docstring): the last turn's ids, each
    turn carrying ids (:data:`TURN_FIELDS`) checked (str content, ids as
    :func:`check_token_ids`, :func:`check_turns`), or NeMo-RL's ``required`` prefix ids;
    refusals name the message or the field."""
    turns: list[Turn] = []
    last_assistant = -1
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            last_assistant = i
        if "prompt_token_ids" not in m and "generation_token_ids" not in m:
            continue
        content = m.get("content")
        if not isinstance(content, str):
            return _bad(f"messages[{i}]: a turn with token ids needs str content", "messages")
        ids: list[tuple[int, ...]] = []
        for field in ("prompt_token_ids", "generation_token_ids"):
            checked = check_token_ids(
                m.get(field), f"messages[{i}].{field}", param="messages", vocab_size=vocab_size
            )
            if isinstance(checked, Failure):
                return checked
            ids.append(checked.unwrap())
        turns.append(Turn(i, content, *ids))
    reference: tuple[int, ...] = ()
    if turns:
        agreed = check_turns(turns, decode_text)
        if isinstance(agreed, Failure):
            return _bad(str(agreed.failure()), "messages")
        reference = agreed.unwrap()
    if required is None:
        return Success(ChatReference(reference, turns[-1].message if turns else last_assistant))
    name = "required_prefix_token_ids"
    return check_token_ids(required, name, param=name, vocab_size=vocab_size).map(
        lambda prefix: ChatReference(prefix, last_assistant)
    )


def template_source(payload: Mapping[str, object], served: str | None) -> str:
    """Which chat template rendered a tokenize ``payload`` (with its kwargs), for a
    refusal: the request's own, the server's (``served``), or the model's."""
    if "chat_template" in payload:
        source = "the request's chat_template"
    elif served is not None:
        source = "vllm_cfg.http_server_serving_chat_kwargs.chat_template"
    else:
        source = "the model's own, from its tokenizer config"
    if "chat_template_kwargs" in payload:
        source += f", with chat_template_kwargs {payload['chat_template_kwargs']!r}"
    return source


def check_turns(
    turns: Sequence[Turn], decode_text: Callable[[Sequence[int]], str]
) -> Result[tuple[int, ...], PrefixMismatch]:
    """The last turn's reference ids, once every turn agrees with its text and with the
    turn before it. ``decode_text`` is the server's detokenizer for returned text."""
    previous: Turn | None = None
    for turn in turns:
        text = decode_text(turn.generation_ids)
        if not same_returned_text(text, turn.content):
            return Failure(
                PrefixMismatch(
                    f"messages[{turn.message}]: the content ({turn.content[:60]!r}) is not "
                    f"the text of its generation_token_ids ({text[:60]!r})",
                    message_index=turn.message,
                )
            )
        if previous is not None:
            ref = previous.reference
            if turn.prompt_ids[: len(ref)] != ref:
                return Failure(
                    PrefixMismatch(
                        f"messages[{turn.message}]: its prompt_token_ids do not start with "
                        f"the prompt and generation ids of messages[{previous.message}]",
                        message_index=turn.message,
                    )
                )
        previous = turn
    return Success(() if previous is None else previous.reference)


def splice_prefix(
    reference: Sequence[int],
    template_ids: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    *,
    message: int,
) -> Result[tuple[int, ...], PrefixMismatch]:
    """The prompt: ``reference`` verbatim, then the template's tokens after its text.

    ``template_ids`` is the whole conversation rendered and tokenized by the server;
    ``decode`` the tokenizer's full decode (special tokens kept); ``message`` the message
    the reference ends at (named in the error).
    """
    ref = tuple(reference)
    actual = tuple(template_ids)
    if actual[: len(ref)] == ref:
        return Success(actual)
    # A generation that ended inside a character returned its text without it
    # (``same_returned_text``): the template renders that text, the ids keep the bytes,
    # which decode to U+FFFD (at the end, or before the next turn's tokens). The texts
    # are compared without replacement characters.
    ref_text = _visible(decode(ref))
    if not _visible(decode(actual)).startswith(ref_text):
        return Failure(
            PrefixMismatch(
                f"messages[{message}]: the conversation up to it does not render to the text "
                "of the ids it carries (the history was edited, or the ids belong to "
                "another conversation)",
                message_index=message,
            )
        )
    n = min(len(ref), len(actual))
    text = _visible(decode(actual[:n]))
    while len(text) > len(ref_text) and n > 0:
        n -= 1
        text = _visible(decode(actual[:n]))
    while len(text) < len(ref_text) and n < len(actual):
        n += 1
        text = _visible(decode(actual[:n]))
    if text != ref_text:
        return Failure(
            PrefixMismatch(
                f"messages[{message}]: the text of its ids ends inside a token of the "
                "rendered conversation; the ids cannot be kept verbatim",
                message_index=message,
            )
        )
    return Success(ref + actual[n:])


def _visible(text: str) -> str:
    return text.replace(REPLACEMENT_CHARACTER, "")


def check_template_stable(
    alone: Sequence[int],
    whole: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    *,
    message: int,
    template: str,
) -> Result[None, PrefixMismatch]:
    """Why a conversation did not render to its reference's text (``splice_prefix``
    failed): ``alone`` is the template's rendering of ``messages[0..message]`` by itself,
    ``whole`` the whole conversation's. A template whose rendering of the first messages
    is not the start of the whole one's is not prefix-stable (it renders an earlier turn
    differently once later messages follow: Qwen3's drops earlier thinking); the ids of
    that turn cannot be kept, and the refusal names ``template``, not the caller. A
    stable template: ``Success``, the history itself differs from its ids."""
    if decode(whole).startswith(decode(alone)):
        return Success(None)
    return Failure(
        PrefixMismatch(
            f"messages[{message}]: the chat template ({template}) is not prefix-stable: it "
            f"renders messages[0..{message}] differently once later messages follow, so the "
            "ids returned with that turn cannot be kept verbatim. Send the whole prompt's "
            "ids to /v1/completions, or serve with a prefix-stable template "
            "(vllm_cfg.http_server_serving_chat_kwargs.chat_template)",
            message_index=message,
        )
    )


# --- request bodies and prompts ----------------------------------------------------------

MAX_JSON_DEPTH: Final = 128
"""Nesting levels a request body may have (an object or array is one level)."""
CHARS_PER_TOKEN_AT_MOST: Final = 32
"""Characters per context token a text prompt may have before it is refused untokenized."""
BODY_BYTES_FLOOR: Final = 32 << 20
"""Bytes every body may have, whatever the context (images as data URLs, short contexts)."""
BODY_BYTES_PER_TOKEN: Final = 512
"""Further bytes per context token: a text at the character bound, every character escaped
as a UTF-16 surrogate pair (12 bytes), is 384 per token; an id list is at most 9."""


@attrs.frozen
class HttpLimits:
    """What one request to the server may be (see the module docstring)."""

    max_body_bytes: int = attrs.field(validator=attrs.validators.ge(1))
    max_depth: int = attrs.field(validator=attrs.validators.ge(1))
    max_prompt_chars: int = attrs.field(validator=attrs.validators.ge(1))
    vocab_size: int = attrs.field(validator=attrs.validators.ge(1))


def http_limits(max_model_len: int, vocab_size: int) -> HttpLimits:
    """The limits of a server whose engine has ``max_model_len`` and ``vocab_size``."""
    return HttpLimits(
        max_body_bytes=BODY_BYTES_FLOOR + BODY_BYTES_PER_TOKEN * max_model_len,
        max_depth=MAX_JSON_DEPTH,
        max_prompt_chars=CHARS_PER_TOKEN_AT_MOST * max_model_len,
        vocab_size=vocab_size,
    )


@attrs.frozen
class BadRequest(CoreError):
    """A request the server refuses: the HTTP ``status`` (4xx) and the request's field
    (``None``: the body as a whole)."""

    status: int
    param: str | None


def error_body(status: int, message: str, param: str | None) -> dict[str, object]:
    """An OpenAI-style error body (vLLM's ``ErrorResponse`` shape)."""
    kind = "BadRequestError" if status < 500 else "ServiceUnavailableError"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@attrs.frozen
class MalformedBody(CoreError):
    """The body is not JSON; vLLM's own answer says so."""


def tokenize_answer(status: int, answer: object) -> Result[list[int], BadRequest]:
    """The ids of vLLM's ``/tokenize`` answer, or its refusal passed on (4xx as 400, any
    other as 500) with vLLM's own message."""
    if status != 200 or not isinstance(answer, dict):
        message = answer.get("error", answer) if isinstance(answer, dict) else answer
        if isinstance(message, dict):
            message = message.get("message", message)
        return Failure(
            BadRequest(str(message), status=400 if 400 <= status < 500 else 500, param=None)
        )
    tokens = answer.get("tokens")
    assert isinstance(tokens, list), answer  # vLLM's TokenizeResponse
    return Success(tokens)


def check_body_length(num_bytes: int, limits: HttpLimits) -> Result[int, BadRequest]:
    """``num_bytes`` when a body that long may be read (a declared ``content-length`` or
    the bytes read so far), else 413."""
    if num_bytes > limits.max_body_bytes:
        return Failure(
            BadRequest(
                f"the request body has more than {limits.max_body_bytes} bytes, the server's limit",
                status=413,
                param=None,
            )
        )
    return Success(num_bytes)


def late_body(timeout_s: float, num_bytes: int) -> BadRequest:
    """The 408 of a body that did not arrive whole within ``timeout_s`` (``num_bytes`` came);
    the connection is closed after it."""
    return BadRequest(
        f"the request body did not arrive within {timeout_s:g} s ({num_bytes} bytes came)",
        status=408,
        param=None,
    )


def json_depth(value: object, limit: int) -> int:
    """The nesting depth of a parsed JSON ``value`` (a scalar: 0), counted up to
    ``limit + 1``: any deeper value gives ``limit + 1``. Iterative, so no depth recurses."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Iterable[object] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _too_deep(limits: HttpLimits) -> Failure[BadRequest]:
    return Failure(
        BadRequest(
            f"the request body nests deeper than {limits.max_depth} levels, the server's limit",
            status=400,
            param=None,
        )
    )


def parse_body(raw: bytes, limits: HttpLimits) -> Result[object, BadRequest | MalformedBody]:
    """The JSON value of a request body, within the size and depth limits."""
    too_long = check_body_length(len(raw), limits)
    if isinstance(too_long, Failure):
        return too_long
    try:
        value: object = json.loads(raw)
    except RecursionError:
        return _too_deep(limits)
    except ValueError as e:  # UnicodeDecodeError included
        return Failure(MalformedBody(f"the request body is not JSON: {e}"))
    if _brackets(raw) > limits.max_depth and json_depth(value, limits.max_depth) > limits.max_depth:
        return _too_deep(limits)
    return Success(value)


def _brackets(raw: bytes) -> int:
    """An upper bound on the nesting of ``raw``: a body with few brackets is not walked."""
    return raw.count(b"[") + raw.count(b"{")


def check_nesting(raw: bytes, limits: HttpLimits) -> Result[bytes, BadRequest]:
    """``raw`` unless it is JSON nested past the depth limit: for a body another route
    parses (one with at most ``max_depth`` brackets is not even parsed here)."""
    if _brackets(raw) <= limits.max_depth:
        return Success(raw)
    parsed = parse_body(raw, limits)
    if isinstance(parsed, Failure):
        problem = parsed.failure()
        if isinstance(problem, BadRequest):
            return Failure(problem)
    return Success(raw)


def _shown(value: object) -> str:
    return json.dumps(value, default=repr)[:80]


def _bad(message: str, param: str) -> Failure[BadRequest]:
    return Failure(BadRequest(message, status=400, param=param))


def check_token_ids(
    value: object, name: str, *, param: str, vocab_size: int, allow_empty: bool = True
) -> Result[tuple[int, ...], BadRequest]:
    """``value`` as token ids: a list of ints (no bools) in ``[0, vocab_size)``; ``name``
    is the field's path in the request (named with the index of a bad id), ``param`` the
    top-level field the refusal names."""
    if not isinstance(value, list):
        return _bad(f"{name} must be a list of token ids, got {_shown(value)}", param)
    if not value:
        return Success(()) if allow_empty else _bad(f"{name} must not be empty", param)
    # The usual list, all good, is judged at C speed; a bad one is looked through.
    if {*map(type, value)} == {int} and min(value) >= 0 and max(value) < vocab_size:
        return Success(tuple(value))
    i, t = next((i, t) for i, t in enumerate(value) if not _is_id(t, vocab_size))
    if type(t) is not int:
        return _bad(f"{name}[{i}]: {_shown(t)} is not a token id (an int)", param)
    return _bad(f"{name}[{i}]: token id {t} is outside the vocabulary [0, {vocab_size})", param)


def _is_id(value: object, vocab_size: int) -> bool:
    return type(value) is int and 0 <= value < vocab_size


def _check_text(text: str, name: str, limits: HttpLimits) -> Result[str, BadRequest]:
    if not text:
        return _bad(f"{name} must not be empty", "prompt")
    if len(text) > limits.max_prompt_chars:
        return _bad(_too_long(name, len(text), limits), "prompt")
    return Success(text)


def _too_long(name: str, chars: int, limits: HttpLimits) -> str:
    return (
        f"{name} has {chars} characters, more than the {limits.max_prompt_chars} "
        f"({CHARS_PER_TOKEN_AT_MOST} per token of max_model_len) any prompt that fits the "
        "context can have; refused before tokenizing"
    )


def check_completion_prompt(
    prompt: object, limits: HttpLimits
) -> Result[tuple[str | tuple[int, ...], ...], BadRequest]:
    """A completion request's ``prompt`` as its prompts: a text, token ids, a list of
    texts or a list of token id lists (vLLM's ``CompletionRequest.prompt``), each one
    non-empty, texts within the character bound, ids within the vocabulary."""
    if isinstance(prompt, str):
        return _check_text(prompt, "prompt", limits).map(lambda text: (text,))
    if prompt == []:
        return _bad("prompt must not be empty", "prompt")
    if not isinstance(prompt, list):
        return _bad(
            "prompt must be a str, a list of str, token ids or a list of token id lists, "
            f"got {_shown(prompt)}",
            "prompt",
        )
    first = prompt[0]
    if not isinstance(first, str | list):
        return check_token_ids(prompt, "prompt", param="prompt", vocab_size=limits.vocab_size).map(
            lambda ids: (ids,)
        )
    prompts: list[str | tuple[int, ...]] = []
    for i, p in enumerate(prompt):
        name = f"prompt[{i}]"
        checked: Result[str, BadRequest] | Result[tuple[int, ...], BadRequest]
        if isinstance(first, str):
            if not isinstance(p, str):
                return _bad(f"{name} must be a str like prompt[0], got {_shown(p)}", "prompt")
            checked = _check_text(p, name, limits)
        else:
            checked = check_token_ids(
                p, name, param="prompt", vocab_size=limits.vocab_size, allow_empty=False
            )
        if isinstance(checked, Failure):
            return checked
        prompts.append(checked.unwrap())
    return Success(tuple(prompts))


def check_chat_text(messages: Sequence[object], limits: HttpLimits) -> Result[int, BadRequest]:
    """The characters of a chat request's text (every message's ``content``, a str or
    its ``text`` parts), refused past the character bound before the conversation is
    rendered and tokenized."""
    total = 0
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                if isinstance(text, str):
                    total += len(text)
        if total > limits.max_prompt_chars:
            return Failure(
                BadRequest(
                    _too_long(f"the text of messages[0..{i}]", total, limits),
                    status=400,
                    param="messages",
                )
            )
    return Success(total)


# --- routed experts --------------------------------------------------------------------

#: genworker's request field asking for the choices' routed experts (docs/r3.md)
ROUTES_FIELD: Final = "return_routed_experts"
#: the field of a choice where vLLM puts them (base64 ``.npy``, ``CompletionResponseChoice``
#: and ``ChatCompletionResponseChoice``, vLLM 0.32)
ROUTES_CHOICE_FIELD: Final = "routed_experts"


def check_routes_request(body: Mapping[str, object], *, captures: bool) -> Result[bool, BadRequest]:
    """Whether a request asks for its routed experts (:data:`ROUTES_FIELD`, opt-in: vLLM
    adds them to every choice when its engine captures, ``prompt + generated - 1`` rows of
    ``num_layers x top_k`` ids each). Refused naming the field: not a bool; asked of an
    engine that does not capture; asked with ``stream`` (vLLM returns them with
    non-streamed responses only)."""
    wanted = body.get(ROUTES_FIELD, False)
    if type(wanted) is not bool:
        return _bad(f"{ROUTES_FIELD} must be true or false, got {_shown(wanted)}", ROUTES_FIELD)
    if not wanted:
        return Success(False)
    if not captures:
        return _bad(
            f"{ROUTES_FIELD}: this server's engine does not capture routed experts (set "
            "enable_return_routed_experts: true in the worker config, on a platform that "
            "can capture: docs/r3.md)",
            ROUTES_FIELD,
        )
    if body.get("stream") is True:
        return _bad(
            f"{ROUTES_FIELD}: vLLM returns routed experts with non-streamed responses "
            "only; ask without stream",
            ROUTES_FIELD,
        )
    return Success(True)


def drop_routes(raw: bytes) -> bytes:
    """A non-streamed completion or chat response without its choices'
    :data:`ROUTES_CHOICE_FIELD`, serialised compactly; bytes that hold no such field (not
    JSON, no choices) come back as they are."""
    try:
        response = json.loads(raw)
    except ValueError:
        return raw
    choices = response.get("choices") if isinstance(response, dict) else None
    if not isinstance(choices, list):
        return raw
    held = [c for c in choices if isinstance(c, dict) and ROUTES_CHOICE_FIELD in c]
    if not held:
        return raw
    for choice in held:
        del choice[ROUTES_CHOICE_FIELD]
    return json.dumps(response, ensure_ascii=False, separators=(",", ":")).encode()


# --- versions --------------------------------------------------------------------------


def versions_between(first: int, last: int) -> tuple[int, ...]:
    """The weight versions a request in flight from ``first`` to ``last`` ran under."""
    if last < first:
        raise ValueError(f"weight versions only go up: {first} -> {last}")
    return tuple(range(first, last + 1))


def split_events(buffer: bytes, more: bool) -> tuple[bytes | None, bytes]:
    """A streamed body's ``buffer`` (bytes not yet sent) as ``(events to send, rest)``:
    the whole server-sent events in it (each ends in a blank line), or everything once
    the body ends (``more`` false); ``None`` while no event is whole yet."""
    done, _, rest = buffer.rpartition(b"\n\n")
    if not more:
        return (done + b"\n\n" if done else b"") + rest, b""
    if not done:
        return None, rest
    return done + b"\n\n", rest


def tag_events(events: bytes, versions: Sequence[int]) -> bytes:
    """Server-sent ``events`` (whole events, each ending in a blank line) with
    ``weight_versions`` added to every ``data:`` line that is a JSON object: the line is
    parsed and serialised again, never edited as bytes (a completion's text may itself
    contain ``data: {``; JSON escapes newlines, so a blank line only ends an event)."""
    lines = events.split(b"\n")
    for i, line in enumerate(lines):
        if not line.startswith(b"data: {"):
            continue
        try:
            event = json.loads(line[len(b"data: ") :])
        except ValueError:  # not ours to judge: the client sees vLLM's bytes
            continue
        tagged = {"weight_versions": list(versions), **event}  # "{...}" parses to a dict
        lines[i] = b"data: " + json.dumps(tagged, ensure_ascii=False).encode()
    return b"\n".join(lines)
