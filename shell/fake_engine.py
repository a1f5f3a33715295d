"""A deterministic, pure-Python engine for tests (ours and users').

``FakeEngine`` implements :class:`genworker.shell.ports.EnginePort` without vLLM. Its
tokens are a function of (engine seed, weight version, prompt, position, request seed,
greedy, the row's adapter name) only, so two fakes with the same seed agree and a batch's
row results do not depend on the other rows. It follows vLLM's contract where the worker
relies on it:

- generation stops at ``max_tokens`` or at the context end (``max_model_len``) with finish
  reason ``"length"``, at a stop token id or the EOS id (unless ``ignore_eos``) with
  ``"stop"``, or when the detokenised output ends with a stop string (kept in the output,
  as with ``include_stop_str_in_output=True``);
- a prompt of ``max_model_len`` tokens or more (no room for one token: vLLM 0.32's
  ``InputProcessor._validate_prompt_len``), or an empty one, is a ``BadBatchError``;
- sleep level 2 discards weights: generating after it without new weights gives garbage
  in vLLM; here it raises ``FakeEngineMisuse`` so a test sees the worker let it through;
- ``generate`` returns the batch as ``FlatGenerations``; ``generate_text`` refuses what
  the vLLM adapter refuses (``core.engine_calls.text_refusal``: a spec without
  ``detokenize``, sample counts) with ``FakeEngineMisuse``, and checks its rows as it
  does (aborted rows, non-finite logprobs under the engine's ``logprobs_mode``, from the
  factory's ``logprobs_mode`` kwarg);
- ``next_logprobs`` / ``next_finish`` (row -> value, for the next generate or
  generate_text call only) make a row come back as vLLM's do when its logits are garbage
  (every sampled logprob that value: NaN, +inf, or a masked token's -inf) or when the
  engine aborted it (``"abort"``: finish reason abort with the first half of its tokens);
- sleep and wake follow vLLM's ``Executor`` (``vllm/v1/executor/abstract.py``, 0.32):
  ``sleep`` does nothing while the weights are asleep (whatever the level), ``wake_up``
  does nothing when nothing sleeps, and a ``wake_up(tags)`` naming a tag that is awake
  drops the WHOLE call, waking none of its tags (vllm#31618);
- the engine's speculative decoding: ``num_speculative_tokens`` in the capabilities is
  the config's count, or the drafter's (``FakeEngineFactory(draft_tokens=k)``) when the
  config leaves it out, as vLLM infers it; neither is vLLM's start error;
- ``fail_next`` injects the failures an engine adapter raises (``BadBatchError`` for a
  request vLLM rejects, ``EngineDeadError`` for a dead engine), as the port promises, into
  the next call, or with ``fail_call`` set into the next call of that name (``"sleep"``,
  ``"wake_up"``, ``"generate"``...);
- a sleep or wake that fails (anything but a typed refusal) fails part-way, as vLLM 0.32's
  do: ``CuMemAllocator.sleep`` / ``wake_up`` (vllm/device_allocator/cumem.py) unmap or map
  allocation after allocation, and ``EngineCore.sleep`` pauses the scheduler first and
  does not resume it when the executor raises; here the KV cache is left asleep, so a
  generate let through afterwards is a ``FakeEngineMisuse``. ``wake_up`` returns whether
  the engine is fully awake afterwards (``LLM.wake_up``'s answer);
- with ``routes`` (a :class:`~genworker.core.routing.MoeShape`; the factory's ``moe``
  option, turned on by the engine kwarg ``enable_return_routed_experts`` as vLLM's is) each
  generation carries routed experts as vLLM returns them: one ``(layers, top_k)`` row of
  distinct expert ids per forwarded token (the prompt's and the generated ones but the
  last), a function of (seed, weight version, token, position) only
  (``core.fake_model.fake_routes``); the kwarg without ``moe`` fails to start, as vLLM
  refuses the capture for a dense model;
- with ``image_token_id`` set it takes images: each placeholder id of a media row stands
  for ``image_prompt_ids`` ids of the context (vLLM's expansion; the room to generate
  shrinks accordingly) and the tokens depend on the images' sizes and pixels too. A row
  whose images and placeholders differ in number is refused (vLLM asserts or silently
  keeps the placeholders as text: the worker must not let it through), and so is a media
  row without ``image_token_id`` (FakeEngineMisuse). ``reset_mm_cache`` and
  ``reset_encoder_cache`` count their calls.

Tokenisation and detokenisation are one letter per token id
(``"abcdefghijklmnopqrstuvwxyz"[id % 26]``; other characters tokenise to 0): ``tokenize``
gives a text prompt's ids, whose count is what ``generate_text``'s per-row caps see.

``FakeEngineBase`` holds what this fake shares with the async one (``fake_async_engine``):
the options, the call log and injected failures, the tokenizer, the images' expansion,
the counters and the RPC handlers; ``FakeEngineFactoryBase`` what their factories share.
The pure rules of their made-up model are ``core.fake_model``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar, Unpack

import attrs

from genworker.core.assembly import FlatGenerations, Generation, flatten_generations
from genworker.core.counters import MetricSample
from genworker.core.engine_calls import Cache, EngineBatch, RpcCall, text_refusal
from genworker.core.fake_model import (
    MEMORY_TAGS,
    FakeEngineOptions,
    detokenize,
    draw,
    expanded_length,
    fake_capabilities,
    fake_metrics,
    faulted,
    finish_reason,
    image_digest,
    request_routes,
    routes_option,
    sample_token,
    score_row,
    speculative_tokens,
    tokenize,
    unservable,
    waking,
)
from genworker.core.routing import CapturePlatform
from genworker.core.sampling import SamplingSpec
from genworker.core.scoring import ScoredRow
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineDeadError,
    EngineStateError,
    UnsupportedError,
    unwrap,
)
from genworker.shell.media import RowMedia
from genworker.shell.ports import EngineCapabilities, check_text_rows

__all__ = [
    "FakeEngine",
    "FakeEngineBase",
    "FakeEngineFactory",
    "FakeEngineFactoryBase",
    "FakeEngineMisuse",
    "FakeEngineOptions",
    "FakeRequest",
]


class FakeEngineMisuse(RuntimeError):
    """The worker let a call through that a real engine would turn into garbage or a crash."""


def pixels(media: RowMedia | None) -> tuple[str, ...]:
    """What a fake's tokens see of a row's images: a digest of each (its bytes, its size)."""
    if media is None:
        return ()
    return tuple(image_digest(i.tobytes(), i.size) for i in media.images)


@attrs.define(eq=False, kw_only=True)
class FakeRequest:
    """One request as a fake runs it, token by token (:meth:`FakeEngineBase._next_token`)."""

    prompt: tuple[int, ...]
    spec: SamplingSpec
    context: int  # what the prompt holds in the context (images expanded)
    pixels: tuple[str, ...] = ()  # what the tokens see of the images
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    versions: list[int] = attrs.Factory(list)  # the weights version of each token
    text: str = ""


class FakeEngineBase:
    """What the sync and the async fake share (the module docstring's last paragraph)."""

    def __init__(self, **options: Unpack[FakeEngineOptions]) -> None:
        self._caps = fake_capabilities(options)
        device = self._caps.device
        self.image_prompt_ids = options.get("image_prompt_ids", 7)
        self.eos_token_id = options.get("eos_token_id", 1)
        self.seed = options.get("seed", 0)
        self.weight_version = 0
        self.awake_tags: set[str] = {"weights", "kv_cache"}
        self.sleep_level = 0
        self.weights_discarded = False
        self.calls: list[str] = []
        self.prompt_tokens = self.generation_tokens = self.prefix_cache_resets = 0
        self.mm_cache_resets = self.encoder_cache_resets = 0
        self.fail_next: BaseException | None = None
        #: the name of the call ``fail_next`` waits for (None: the next call of any name)
        self.fail_call: str | None = None
        self.rpc_handlers: dict[str, Callable[..., object]] = {
            "report_device_id": lambda: f"fake-{device}",
            "prepare_refit_info": lambda info: {"tensors": len(info)},
        }
        self.shut_down = False

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    def _refusal(self, call: str) -> str | None:
        """Why ``call`` and every later call are refused (None: the engine serves)."""
        return "the fake engine was shut down" if self.shut_down else None

    def _enter(self, call: str) -> None:
        self.calls.append(call)
        refusal = self._refusal(call)
        if refusal is not None:
            raise EngineDeadError(refusal)
        if self.fail_next is not None and (
            self.fail_call is None or call.split("(")[0] == self.fail_call
        ):
            error, self.fail_next, self.fail_call = self.fail_next, None, None
            raise error

    def _enter_memory_call(self, call: str) -> None:
        """``_enter`` for a sleep or wake: a failure other than a typed refusal strikes
        part-way (see the module docstring), leaving the KV cache asleep."""
        try:
            self._enter(call)
        except (BadArgumentError, EngineStateError, UnsupportedError):
            raise
        except BaseException:
            if self._refusal(call) is None:
                self.awake_tags.discard("kv_cache")
            raise

    def _expanded(self, prompt: Sequence[int], media: RowMedia | None) -> int:
        """A fake's context length of ``prompt``: each image's placeholder stands for
        ``image_prompt_ids`` ids; images that do not match the placeholders are refused, as
        vLLM's processor refuses (or mangles) them."""
        if media is None:
            return len(prompt)
        if (placeholder := self._caps.image_token_id) is None:
            raise FakeEngineMisuse("media for a fake engine without image_token_id")
        counted = expanded_length(prompt, len(media.images), placeholder, self.image_prompt_ids)
        return unwrap(counted, BadBatchError, "")

    def _context(self, prompt: Sequence[int], media: RowMedia | None) -> int:
        """What a prompt holds in the context; vLLM's refusals of an empty prompt and of
        one that leaves no room for a token (``InputProcessor._validate_prompt_len``)."""
        if not prompt:
            raise BadBatchError("prompt cannot be empty")
        context = self._expanded(prompt, media)
        if context >= self._caps.max_model_len:
            raise BadBatchError("prompt is at least max_model_len long")
        return context

    def _check_servable(self, call: str) -> None:
        """What a real engine would silently get wrong: running with memory asleep, or on
        the garbage a level-2 sleep leaves without new weights."""
        if problem := unservable(call, self.awake_tags, self.weights_discarded):
            raise FakeEngineMisuse(problem)

    def _next_token(self, request: FakeRequest, u: float) -> str | None:
        """``request``'s next token from the draw ``u`` (the fakes' made-up model), under
        the weights now; its finish reason once it ends: vLLM's stop rule (a stop token id,
        the EOS id unless ``ignore_eos``, the text so far ending with a stop string), else
        ``max_tokens`` or the context's end (``core.fake_model``)."""
        spec = request.spec
        token, logprob = sample_token(u, self._caps.vocab_size or 64, spec.temperature == 0.0)
        request.tokens.append(token)
        request.logprobs.append(logprob)
        request.versions.append(self.weight_version)
        request.text += detokenize([token])
        room = self._caps.max_model_len - request.context
        return finish_reason(
            spec, token, request.text, len(request.tokens), room, self.eos_token_id
        )

    def _generation(self, request: FakeRequest, finish: str) -> Generation:
        """A finished request as vLLM returns it; its routes (``routes``) as
        ``core.fake_model.request_routes`` lays them over the weights versions."""
        shape, routes = self._caps.routes, None
        if shape is not None:
            now = self.weight_version
            routes = request_routes(
                shape, self.seed, request.prompt, request.tokens, request.versions, now
            )
        return Generation(request.tokens, request.logprobs, finish, routes)

    def _score(self, sequence: Sequence[int], start: int, top_k: int) -> ScoredRow:
        """The fakes' made-up model, deterministic in the prefix: the given tokens'
        logprobs from ``start`` on and ``top_k`` others, ranked, at each of those positions
        (vLLM's ``prompt_logprobs``; ``core.fake_model.score_row``)."""
        self._check_servable("compute_logprobs")
        if not 1 <= start < len(sequence) < self._caps.max_model_len:
            raise FakeEngineMisuse("compute_logprobs of an unchecked sequence")
        vocab = self._caps.vocab_size or 64
        return score_row(
            sequence, start, top_k, seed=self.seed, weights=self.weight_version, vocab_size=vocab
        )

    def _sleep(self, level: int, in_flight: int = 0) -> None:
        """vLLM's ``Executor.sleep`` (see the module docstring): nothing while the weights
        are asleep; ``in_flight`` requests are a misuse (the async worker pauses first)."""
        self._enter_memory_call(f"sleep({level})")
        if in_flight:
            raise FakeEngineMisuse("sleep with requests in flight")
        if "weights" not in self.awake_tags:
            return  # vLLM: "Executor is already sleeping."
        self.sleep_level = level
        self.awake_tags.clear()
        if level == 2:
            self.weights_discarded = True

    def _wake_up(self, tags: Sequence[str] | None) -> bool:
        """vLLM's ``Executor.wake_up`` (see the module docstring); whether the engine is
        fully awake afterwards."""
        self._enter_memory_call(f"wake_up({None if tags is None else sorted(tags)})")
        self.awake_tags |= waking(self.awake_tags, tags)
        awake = self.awake_tags == MEMORY_TAGS
        if awake:
            self.sleep_level = 0
        return awake

    def _reset_cache(self, cache: Cache, running: int = 0) -> None:
        """Count the reset of ``cache``; a prefix cache with ``running`` requests is kept,
        as vLLM keeps it (``EngineStateError``)."""
        self._enter(cache.call)
        if cache is Cache.PREFIX and running:
            raise EngineStateError(cache.kept)
        if cache is Cache.PREFIX:
            self.prefix_cache_resets += 1
        elif cache is Cache.MM:
            self.mm_cache_resets += 1
        else:
            self.encoder_cache_resets += 1

    def tokenize(self, prompts: Sequence[str]) -> list[list[int]]:
        """One id per letter, 0 for anything else (the module docstring's tokenisation)."""
        self._enter("tokenize")
        return [tokenize(p) for p in prompts]

    def expanded_lengths(
        self, prompts: Sequence[Sequence[int]], media: Sequence[RowMedia | None]
    ) -> list[int]:
        self._enter("expanded_lengths")
        return [self._expanded(p, m) for p, m in zip(prompts, media, strict=True)]

    def metrics(self) -> list[MetricSample]:
        self._enter("metrics")
        return fake_metrics(self.prompt_tokens, self.generation_tokens)

    def load_new_weights(self) -> None:
        """What a successful refit does to the fake: new tokens, weights valid again."""
        if "weights" not in self.awake_tags:
            raise FakeEngineMisuse("weights written while their memory is asleep")
        self.weight_version += 1
        self.weights_discarded = False

    def _rpc(self, call: RpcCall) -> object:
        """What the handler of ``call.method`` returns (the one engine worker's answer)."""
        self._enter(f"rpc:{call.method}")
        handler = self.rpc_handlers.get(call.method)
        if handler is None:
            raise AttributeError(f"the fake extension has no method {call.method!r}")
        return handler(*call.args, **(call.kwargs or {}))


_Engine = TypeVar("_Engine", bound=FakeEngineBase)


class FakeEngine(FakeEngineBase):
    """Deterministic engine; see the module docstring for its rules."""

    def __init__(self, **options: Unpack[FakeEngineOptions]) -> None:
        super().__init__(**options)
        #: the next generate call's rows: every sampled logprob of the row becomes this
        self.next_logprobs: dict[int, float] = {}
        #: the next generate call's rows: this finish reason ("abort": half the tokens)
        self.next_finish: dict[int, str] = {}
        self.requests: list[tuple[list[int], SamplingSpec]] = []
        #: the last generate call's ``samples`` (vLLM's ``n`` per prompt; None: one each)
        self.last_samples: list[int] | None = None
        #: each generate call's use_tqdm (the fake draws no progress bar)
        self.progress_bars: list[bool] = []

    # -- generation ------------------------------------------------------------------
    def _sample(self, request: FakeRequest, media: RowMedia | None, child: int) -> Generation:
        """One row run to its end: its tokens drawn from (seed, weights, prompt, greedy,
        request seed, images, adapter, vLLM's child index) and the position."""
        spec = request.spec
        key: tuple[object, ...] = (
            self.seed,
            self.weight_version,
            request.prompt,
            spec.temperature == 0.0,
            spec.seed,
            pixels(media),
        )
        if spec.adapter is not None:  # a row under an adapter samples other tokens
            key = (*key, spec.adapter.name)
        if child:  # vLLM's n: each child samples on its own (an unseeded one at random)
            key = (*key, child)
        finish = None
        while finish is None:
            finish = self._next_token(request, draw(*key, len(request.tokens)))
        return self._generation(request, finish)

    def generate(self, batch: EngineBatch[RowMedia], *, use_tqdm: bool = False) -> FlatGenerations:
        self.last_samples = None if batch.samples is None else list(batch.samples)
        return flatten_generations(self._generations(batch, use_tqdm))

    def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], top_k: int
    ) -> list[ScoredRow]:
        self._enter("compute_logprobs")
        return [
            self._score(s, start, top_k) for s, start in zip(sequences, prompt_lengths, strict=True)
        ]

    def _generations(self, batch: EngineBatch[RowMedia], use_tqdm: bool) -> list[Generation]:
        self._enter("generate")
        self.progress_bars.append(use_tqdm)
        self._check_servable("generate")
        logprob_faults, self.next_logprobs = self.next_logprobs, {}
        finish_faults, self.next_finish = self.next_finish, {}
        counts = batch.samples or (1,) * len(batch.prompts)
        rows = zip(batch.prompts, batch.specs, batch.row_media(), counts, strict=True)
        out: list[Generation] = []
        for prompt, spec, row_media, n in rows:
            context = self._context(prompt, row_media)
            if n > 1 and spec.greedy:  # vLLM's SamplingParams._verify_greedy_sampling
                raise BadBatchError(f"n must be 1 when using greedy sampling, got {n}.")
            for child in range(n):
                row = len(out)  # faults are by output row
                self.requests.append((list(prompt), spec))
                request = FakeRequest(prompt=tuple(prompt), spec=spec, context=context)
                generation = faulted(
                    self._sample(request, row_media, child),
                    logprob_faults.get(row),
                    finish_faults.get(row),
                )
                self.prompt_tokens += context
                self.generation_tokens += len(generation.token_ids)
                out.append(generation)
        return out

    def generate_text(self, batch: EngineBatch[RowMedia], *, use_tqdm: bool = False) -> list[str]:
        self._enter("generate_text")
        if problem := text_refusal(batch.specs, batch.samples):  # as the vLLM adapter refuses
            raise FakeEngineMisuse(problem)
        self._check_servable("generate")
        generations = self._generations(batch, use_tqdm)
        # checked as the vLLM adapter checks it
        check_text_rows(flatten_generations(generations), self._caps.logprobs_mode)
        return [detokenize(g.token_ids) for g in generations]

    # -- memory ----------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        self._sleep(level)

    def wake_up(self, tags: Sequence[str] | None) -> bool:
        return self._wake_up(tags)

    def reset_cache(self, cache: Cache) -> None:
        self._reset_cache(cache)

    # -- RPC -------------------------------------------------------------------------
    def collective_rpc(self, call: RpcCall) -> list[object]:
        return [self._rpc(call)]

    def device_ids(self) -> list[str]:
        return [str(x) for x in self.collective_rpc(RpcCall("report_device_id"))]

    def start_profile(self) -> None:
        self._enter("start_profile")

    def stop_profile(self) -> None:
        self._enter("stop_profile")

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.shut_down = True


class FakeEngineFactoryBase(Generic[_Engine]):
    """What both fakes' factories share: the options every engine gets, the engines started
    with their kwargs (the engine kwargs' ``seed``, 0 unless an int), no GPU, and what the
    engine kwargs change in the options."""

    #: the fake this factory starts
    engine: type[_Engine]

    def __init__(self, **engine_options: object) -> None:
        self.engine_options = engine_options
        self.started: list[tuple[dict[str, object], _Engine]] = []

    def arg_names(self) -> frozenset[str] | None:
        return None

    def gpu_capability(self) -> tuple[int, int] | None:
        return None

    def capture_platform(self) -> CapturePlatform:
        return CapturePlatform(vllm_version=None, triton=False)  # the fake captures itself

    def _options(self, kwargs: Mapping[str, object]) -> dict[str, object]:
        """The engine's options: the factory's, with ``routes`` and the ``logprobs_mode``
        the engine kwargs give (as vLLM takes it from them)."""
        options = dict(self.engine_options)
        routes = routes_option(kwargs, options.pop("moe", None))
        options["routes"] = unwrap(routes, BadConfigError, "")
        mode = kwargs.get("logprobs_mode")
        if isinstance(mode, str):
            options.setdefault("logprobs_mode", mode)
        return options

    def start(self, kwargs: Mapping[str, object]) -> _Engine:
        seed = kwargs.get("seed", 0)
        seed = seed if isinstance(seed, int) else 0
        engine = self.engine(seed=seed, **self._options(kwargs))  # type: ignore[arg-type]
        self.started.append((dict(kwargs), engine))
        return engine


class FakeEngineFactory(FakeEngineFactoryBase[FakeEngine]):
    """Starts ``FakeEngine``s for the worker; records the engine kwargs it was given.

    ``draft_tokens`` is what a drafter would let vLLM infer when a ``speculative_config``
    has no ``num_speculative_tokens`` (``None``: vLLM's start error)."""

    engine = FakeEngine

    def __init__(self, *, draft_tokens: int | None = None, **engine_options: object) -> None:
        super().__init__(**engine_options)
        self.draft_tokens = draft_tokens

    def _options(self, kwargs: Mapping[str, object]) -> dict[str, object]:
        options = super()._options(kwargs)
        k = unwrap(speculative_tokens(kwargs, self.draft_tokens), BadConfigError, "")
        if k is not None:
            options["num_speculative_tokens"] = k
        return options
