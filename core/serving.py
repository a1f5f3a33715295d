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
  template's tokens is refused rather than guessed.
- **Versions** (:func:`versions_between`): the server reads the worker's weight version
  when a request arrives and when its response starts (non-streaming: the generation is
  complete) or when each streamed event passes; a version increases by one per refit, so
  the request was sampled under the versions in between, both included. This is a
  superset of its tokens' versions: a request that finished on the old weights while the
  refit's transfer ran may report both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

import attrs
from returns.result import Failure, Result, Success

from genworker.core.caps import CapError, CapFailure, request_max_tokens
from genworker.core.config import ConfigError, ConfigProblem, WorkerConfig
from genworker.core.config_keys import parse_bool
from genworker.core.errors import CoreError

__all__ = [
    "DEFAULT_HOST",
    "BudgetError",
    "OffPolicy",
    "PrefixMismatch",
    "SamplingPolicy",
    "ServerOptions",
    "Turn",
    "check_on_policy",
    "check_turns",
    "http_max_tokens",
    "prompt_tokens_at_most",
    "server_options",
    "splice_prefix",
    "training_policy",
    "versions_between",
]

DEFAULT_HOST: Final = "127.0.0.1"
_SERVER_KEYS: Final = (
    "http_server_host",
    "http_server_port",
    "http_server_on_policy_guard",
    "http_server_serving_chat_kwargs",
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

    @property
    def loopback(self) -> bool:
        """Whether only this host can connect."""
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")


def _problem(key: str, message: str) -> Failure[ConfigError]:
    return Failure(ConfigError.from_problems([ConfigProblem(f"vllm_cfg.{key}", message)]))


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
    return Success(ServerOptions(host, port, guard, template))


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


def check_turns(
    turns: Sequence[Turn], decode_text: Callable[[Sequence[int]], str]
) -> Result[tuple[int, ...], PrefixMismatch]:
    """The last turn's reference ids, once every turn agrees with its text and with the
    turn before it. ``decode_text`` is the server's detokenizer for returned text."""
    previous: Turn | None = None
    for turn in turns:
        text = decode_text(turn.generation_ids)
        if text != turn.content:
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
    ref_text = decode(ref)
    if not decode(actual).startswith(ref_text):
        return Failure(
            PrefixMismatch(
                f"messages[{message}]: the conversation up to it does not render to the text "
                "of the ids it carries (the history was edited, or the ids belong to "
                "another conversation)",
                message_index=message,
            )
        )
    n = min(len(ref), len(actual))
    text = decode(actual[:n])
    while len(text) > len(ref_text) and n > 0:
        n -= 1
        text = decode(actual[:n])
    while len(text) < len(ref_text) and n < len(actual):
        n += 1
        text = decode(actual[:n])
    if text != ref_text:
        return Failure(
            PrefixMismatch(
                f"messages[{message}]: the text of its ids ends inside a token of the "
                "rendered conversation; the ids cannot be kept verbatim",
                message_index=message,
            )
        )
    return Success(ref + actual[n:])


# --- versions --------------------------------------------------------------------------


def versions_between(first: int, last: int) -> tuple[int, ...]:
    """The weight versions a request in flight from ``first`` to ``last`` ran under."""
    if last < first:
        raise ValueError(f"weight versions only go up: {first} -> {last}")
    return tuple(range(first, last + 1))
