"""The prompt of one generation request to the OpenAI server: the machine that checks a
``/v1/completions`` or ``/v1/chat/completions`` body, fills in the training values and
decides its ``max_tokens`` and, for chat with earlier turns' ids, its prompt ids.

Theory of operation
-------------------
The rules are :mod:`genworker.core.serving`'s (the on-policy guard, the prompt checks, the
context budget, the multi-turn prefix); this module is their order, written once as a
machine in the manner of h11: :meth:`PromptRules.prepare` is a generator that yields
every tokenization it needs (a payload for vLLM's own ``/tokenize`` route: same renderer,
same chat template) and is sent vLLM's answer, ``(status, JSON)``; it returns the request
to send on (:class:`Prepared`) or the refusal (:class:`~genworker.core.serving.BadRequest`).
The shell owns the awaits (an in-process ASGI call per payload) and nothing else.

- **Checks** (``core.serving``): the prompt is never empty; ids are ints, never bools,
  inside the vocabulary, checked before anything decodes them; a text longer than the
  character bound is refused before it is tokenized. Off-policy sampling parameters are
  refused (when the guard is on) and the training values filled in; vLLM is asked for
  ``return_token_ids`` and the sampled tokens' logprobs. Refusals name the parameter or
  the message (400).
- **Budget** (``core.serving.http_max_tokens``): a completion prompt of ids is counted;
  a text prompt whose byte length bounds its tokens well inside the budget
  (:func:`~genworker.core.serving.prompt_tokens_at_most`) is not tokenized: the common
  case asks nothing. A request found complete (every training value, ids, logprobs and
  a ``max_tokens`` within budget already there) is :attr:`Prepared.changed` false. The
  budget of a (``max_tokens``, prompt length) pair is memoized (it is pure).
- **Chat** is always tokenized (the template decides its length). With earlier turns'
  ids (:func:`~genworker.core.serving.chat_reference`) the final ids are the reference
  spliced onto the template's (:func:`~genworker.core.serving.splice_prefix`), handed to
  vLLM as ``kv_transfer_params.prompt_token_ids``, which vLLM's renderer feeds to the
  engine verbatim instead of re-rendering the messages (``renderers/online_renderer.py``
  ``_reused_prompt_token_ids``, vLLM 0.32; a vLLM without it: 501). A splice that fails
  asks for one more tokenization, the conversation up to the reference's message alone,
  to name the template when it is what broke the prefix
  (:func:`~genworker.core.serving.check_template_stable`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Final

import attrs
from returns.result import Failure, Result, Success

from genworker.core.caps import CapFailure
from genworker.core.serving import (
    TURN_FIELDS,
    BadRequest,
    BudgetError,
    HttpLimits,
    SamplingPolicy,
    chat_reference,
    check_chat_text,
    check_completion_prompt,
    check_template_stable,
    http_max_tokens,
    prompt_tokens_at_most,
    request_budget,
    rollout_fills,
    splice_prefix,
    template_source,
    tokenize_answer,
)

__all__ = [
    "TOKENIZE_CHAT_FIELDS",
    "TOKENIZE_FIELDS",
    "Decode",
    "Prepared",
    "PromptRules",
    "Steps",
    "Tokenized",
]

#: a completion request's fields its ``/tokenize`` payload keeps
TOKENIZE_FIELDS: Final[tuple[str, ...]] = ("model", "add_special_tokens")
#: a chat request's fields its ``/tokenize`` payload keeps
TOKENIZE_CHAT_FIELDS: Final[tuple[str, ...]] = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "add_special_tokens",
    "model",
)

Tokenized = tuple[int, object]
"""vLLM's answer to one ``/tokenize`` payload: the HTTP status and the JSON body."""
Decode = Callable[[Sequence[int], bool], str]
"""The server's tokenizer's ``decode(ids, skip_special_tokens)``."""
_Budget = Result[int, BudgetError | CapFailure]

#: budgets of (``max_tokens``, prompt length, the server's settings), least recently used
#: dropped past 4096
_memo_max_tokens = functools.lru_cache(maxsize=4096)(http_max_tokens)


@attrs.frozen
class Prepared:
    """A request to send on: its ``body`` and whether it differs from the bytes that came
    (else they go to vLLM as they are)."""

    body: dict[str, object]
    changed: bool


Steps = Generator[dict[str, object], Tokenized, Result[Prepared, BadRequest]]
"""The machine of :meth:`PromptRules.prepare`: yields ``/tokenize`` payloads, is sent
their answers, returns the decision."""


@attrs.frozen
class PromptRules:
    """One server's settings for the requests it prepares (see the module docstring)."""

    policy: SamplingPolicy | None
    max_new_tokens: int
    max_model_len: int
    cap_to_context: bool
    num_speculative_tokens: int
    limits: HttpLimits
    reuses_prompt_ids: bool
    chat_template: str | None = None

    def budget(self, requested: object, prompt_length: int) -> _Budget:
        """:func:`~genworker.core.serving.http_max_tokens` for this server, memoized for
        the usual ``max_tokens`` (an int or left out): it is pure, and the fast path asks
        it twice."""
        usual = requested is None or type(requested) is int  # never a bool: True == 1
        return (_memo_max_tokens if usual else http_max_tokens)(
            requested,
            prompt_length,
            max_new_tokens=self.max_new_tokens,
            max_model_len=self.max_model_len,
            cap_to_context=self.cap_to_context,
            num_speculative_tokens=self.num_speculative_tokens,
        )

    def fits_untokenized(self, requested: object, prompt: str) -> int | None:
        """The prompt-length bound when ``requested`` fits with it unchanged
        (:func:`~genworker.core.serving.prompt_tokens_at_most`), else None: tokenize."""
        bound = prompt_tokens_at_most(len(prompt.encode()))
        wanted = self.max_new_tokens if requested is None else requested
        budget = self.budget(requested, bound)
        if isinstance(budget, Failure) or budget.unwrap() != wanted:
            return None
        return bound

    def prepare(self, body: Mapping[str, object], *, chat: bool, decode: Decode) -> Steps:
        """The machine for one request's JSON ``body`` (see the module docstring)."""
        fills = rollout_fills(body, self.policy, chat=chat)
        if isinstance(fills, Failure):
            problem = fills.failure()
            return Failure(BadRequest(str(problem), status=400, param=problem.parameter))
        filled = fills.unwrap()
        prepared = {**body, **filled}
        # chat requests lose their turns' ids, may gain prompt ids
        changed = chat or bool(filled)
        if chat:
            length = yield from self._chat_prompt(prepared, decode)
            if isinstance(length, Failure):
                return length
            lengths = [length.unwrap()]
        else:
            prompts = check_completion_prompt(prepared.get("prompt"), self.limits)
            if isinstance(prompts, Failure):
                return prompts
            lengths = []
            for p in prompts.unwrap():
                n = (
                    len(p)
                    if isinstance(p, tuple)
                    else self.fits_untokenized(body.get("max_tokens"), p)
                )
                if n is None:  # a text too long to judge by its bytes: tokenized
                    payload = {k: body[k] for k in TOKENIZE_FIELDS if k in body} | {"prompt": p}
                    tokens = tokenize_answer(*(yield payload))
                    if isinstance(tokens, Failure):
                        return tokens
                    n = len(tokens.unwrap())
                lengths.append(n)
        use_completion = chat and "max_completion_tokens" in prepared
        key = "max_completion_tokens" if use_completion else "max_tokens"
        requested = prepared.get(key)
        prompt = "messages" if chat else "prompt"
        budget = request_budget(requested, lengths, self.budget, key=key, prompt_param=prompt)
        if isinstance(budget, Failure):
            return budget
        decided = budget.unwrap()
        if type(requested) is not int or requested != decided:
            prepared[key] = decided
            changed = True
        return Success(Prepared(prepared, changed))

    def _chat_prompt(
        self, body: dict[str, object], decode: Decode
    ) -> Generator[dict[str, object], Tokenized, Result[int, BadRequest]]:
        """The chat prompt's length; ``body`` loses its turns' ids (genworker's, not
        vLLM's) and gains the prompt's ids where a reference is kept."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return Failure(
                BadRequest("messages must be a list of objects", status=400, param="messages")
            )
        text = check_chat_text(messages, self.limits)
        if isinstance(text, Failure):
            return text
        required = body.pop("required_prefix_token_ids", None)
        read = chat_reference(messages, required, self.limits.vocab_size, lambda i: decode(i, True))
        if isinstance(read, Failure):
            return read
        reference, message = read.unwrap().ids, read.unwrap().message
        messages = [{k: v for k, v in m.items() if k not in TURN_FIELDS} for m in messages]
        body["messages"] = messages
        payload: dict[str, object] = {k: body[k] for k in TOKENIZE_CHAT_FIELDS if k in body}
        payload["messages"] = messages
        template = tokenize_answer(*(yield payload))
        if isinstance(template, Failure) or not reference:
            return template.map(len)
        if not self.reuses_prompt_ids:
            return Failure(
                BadRequest(
                    "this vLLM cannot take a chat prompt as token ids (no "
                    "kv_transfer_params.prompt_token_ids reuse); send the ids to "
                    "/v1/completions",
                    status=501,
                    param="messages",
                )
            )
        whole = template.unwrap()
        spliced = splice_prefix(reference, whole, lambda ids: decode(ids, False), message=message)
        if isinstance(spliced, Failure):
            alone: dict[str, object] = {
                **payload,
                "messages": messages[: message + 1],
                "add_generation_prompt": False,
                "continue_final_message": False,
            }
            rendered = tokenize_answer(*(yield alone))
            if isinstance(rendered, Failure):
                return rendered
            # the template's fault is named; else the history differs from its ids
            checked = check_template_stable(
                rendered.unwrap(),
                whole,
                lambda ids: decode(ids, False),
                message=message,
                template=template_source(payload, self.chat_template),
            )
            problem = checked.failure() if isinstance(checked, Failure) else spliced.failure()
            return Failure(BadRequest(str(problem), status=400, param="messages"))
        ids = list(spliced.unwrap())
        kv = body.get("kv_transfer_params")
        body["kv_transfer_params"] = {
            **(kv if isinstance(kv, dict) else {}),
            "prompt_token_ids": ids,
        }
        return Success(len(ids))
