"""The request plan: one batch's rows to the engine requests both workers send.

Theory of operation
-------------------
Both workers (``shell.worker``'s batch drive loop and ``shell.async_worker``'s streaming
one) turn a batch into requests the same way; this module is that way, written once, as
pure functions over values:

1. :func:`parse_sample_data`: the per-sample data of ``data`` parsed for a batch of B rows:
   each row's seed (``core.batch.check_seeds``) and stop strings (the config's plus the
   row's, ``core.stops.merge_stop_strings`` under a :class:`~genworker.core.stops.StopMode`).
2. :func:`plan_requests`: per planned row (its batch index and what its prompt holds in
   the context: its length, or for a media row the length the engine expands it to), the
   token cap (``core.caps.cap_rows``: the context cap, and the speculative-decoding clamp
   of k + 1 slots) and the :class:`~genworker.core.sampling.SamplingSpec`. A row without
   room for one token gets no spec (``None``): the workers return it unchanged, with no
   tokens, named in ``RequestPlan.no_room``, while the other rows generate. Rows alike
   (same cap, stop strings and seed) share one spec object: vLLM builds one
   ``SamplingParams`` per distinct spec (``shell.vllm_engine``). :func:`plan_batch` is
   steps 1 and 2 as a worker takes them (its config, its engine's caps, its adapters).
3. :func:`check_text_prompts` and :func:`text_refusals`: ``generate_text``'s prompts: a
   list of str; an empty prompt or one whose ids leave no room under ``max_model_len``
   is refused (by row: the sync worker refuses the batch naming every such row, the async
   worker each row alone, with the same rule).

What is batch-level (and so not a law of rows)
----------------------------------------------
The plan of a batch equals the plans of its rows taken one at a time, spec for spec, for
every row the batch plans, with these exceptions, which depend on the batch as a whole:

- the per-sample data's shape: ``seeds`` and ``stop_strings`` hold one entry per batch
  row (a wrong count refuses the batch), and under ``StopMode.BATCH_UNION`` every row's
  stop strings are the union of all rows' (NeMo-RL's sync path);
- an argument error of the caps (``max_new_tokens`` < 1, ``max_model_len`` out of range,
  a negative length) refuses the whole batch (:class:`PlanError`);
- spec *identity* (rows alike share one object) holds within one plan only; specs of
  separate plans are equal, not identical;
- ``RequestPlan.refused``, the one :class:`~genworker.core.caps.CapError` naming every row
  without room, is per batch (its message lists them all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import attrs
from returns.result import Failure, Result, Success

from genworker.core.batch import BatchError, check_seeds
from genworker.core.caps import CapArgumentError, CapError, cap_rows, no_room_error
from genworker.core.config import WorkerConfig
from genworker.core.engine_calls import EngineBatch, EngineCapabilities
from genworker.core.errors import CoreError
from genworker.core.groups import EngineRequest
from genworker.core.lora import NEMO_RL_ADAPTER_NAME, LoraRef, RowAdapterError, row_adapters
from genworker.core.sampling import SamplingDefaults, SamplingSpec, sampling_spec
from genworker.core.stops import StopError, StopMode, merge_stop_strings

__all__ = [
    "PlanError",
    "RequestLimits",
    "RequestPlan",
    "SampleData",
    "TextRefusal",
    "bos_rows",
    "check_greedy",
    "check_text_prompts",
    "parse_sample_data",
    "plan_batch",
    "plan_requests",
    "text_refusals",
]

M = TypeVar("M")


@attrs.frozen
class PlanError(CoreError):
    """A batch the plan refuses whole: ``field`` names the input (``seeds``,
    ``stop_strings``, ``max tokens``, ``prompts``, ``lora``, ``lora_names``, ``greedy``)
    and ``cause`` is the core error."""

    field: str
    cause: BatchError | StopError | CapArgumentError | RowAdapterError | None = None


@attrs.frozen
class RequestLimits:
    """What the config and the running engine fix for every request of a batch."""

    max_new_tokens: int
    max_model_len: int
    cap_to_context: bool = False
    #: draft tokens per step of speculative decoding (0: none); k + 1 slots held back
    num_speculative_tokens: int = 0
    #: the engine returns logprobs flat (vLLM's ``flat_logprobs``)
    flat_logprobs: bool = False

    @classmethod
    def of(cls, config: WorkerConfig, caps: EngineCapabilities) -> RequestLimits:
        """The limits a worker's ``config`` and its running engine (``caps``) fix."""
        return cls(
            max_new_tokens=config.max_new_tokens,
            max_model_len=caps.max_model_len,
            cap_to_context=config.vllm.cap_max_tokens_to_context,
            num_speculative_tokens=caps.num_speculative_tokens,
            flat_logprobs=caps.flat_logprobs,
        )


@attrs.frozen
class SampleData:
    """A batch's per-sample data, parsed: each row's seed and stop strings."""

    seeds: tuple[int | None, ...]
    stops: tuple[tuple[str, ...], ...]
    #: each row's adapter (``core.lora.row_adapters``); empty: every row on the base model
    adapters: tuple[LoraRef | None, ...] = ()

    def __attrs_post_init__(self) -> None:
        if len(self.seeds) != len(self.stops):
            raise ValueError(
                f"SampleData has {len(self.seeds)} seeds but {len(self.stops)} stop lists"
            )

    @property
    def batch_size(self) -> int:
        return len(self.seeds)


def parse_sample_data(
    data: Mapping[str, object],
    batch_size: int,
    *,
    config_stops: Sequence[str],
    mode: StopMode,
    served: Mapping[str, int] | None = None,
    default_adapter: str | None = None,
) -> Result[SampleData, PlanError]:
    """``data["seeds"]``, ``data["stop_strings"]`` and the adapter names ``data["lora"]``
    / ``data["lora_names"]`` (among ``served``, name -> ``lora_int_id``) for a batch of
    ``batch_size`` rows (each absent: no seed, the config's stop strings,
    ``default_adapter`` once served, else the base model); the error names the input."""
    lora, names = data.get("lora"), data.get("lora_names")
    adapters = row_adapters(lora, names, batch_size, served or {}, default_adapter)
    if isinstance(adapters, Failure):
        refused = adapters.failure()
        return Failure(PlanError(refused.message, field=refused.field, cause=refused))
    seeds = check_seeds(data.get("seeds"), batch_size)
    if isinstance(seeds, Failure):
        problem = seeds.failure()
        return Failure(PlanError(problem.message, field="seeds", cause=problem))
    stops = merge_stop_strings(config_stops, data.get("stop_strings"), batch_size, mode)  # type: ignore[arg-type]
    if isinstance(stops, Failure):
        bad = stops.failure()
        return Failure(PlanError(bad.message, field="stop_strings", cause=bad))
    return Success(SampleData(seeds.unwrap(), stops.unwrap(), adapters.unwrap()))


@attrs.frozen
class RequestPlan:
    """One batch's requests: ``specs[i]`` is the spec of batch row ``rows[i]`` (``None``:
    no room for one token); ``refused`` names the rows without room, as batch rows."""

    rows: tuple[int, ...]
    specs: tuple[SamplingSpec | None, ...]
    refused: CapError | None = None

    @property
    def no_room(self) -> tuple[int, ...]:
        """The batch rows without room (they come back unchanged, with no tokens)."""
        return () if self.refused is None else self.refused.rows

    @property
    def kept(self) -> tuple[int, ...]:
        """Positions (into ``rows`` and ``specs``) of the rows that generate."""
        return tuple(i for i, spec in enumerate(self.specs) if spec is not None)

    def requests(self) -> tuple[tuple[int, SamplingSpec], ...]:
        """``(batch row, spec)`` of every row that generates, in plan order."""
        return tuple(
            (row, spec) for row, spec in zip(self.rows, self.specs, strict=True) if spec is not None
        )

    def engine_batch(
        self,
        prompts: Mapping[int, Sequence[int]],
        media: Mapping[int, M] | None = None,
        sent: Sequence[EngineRequest] | None = None,
    ) -> EngineBatch[M]:
        """The engine batch of the rows that generate, each row's prompt (and media, when
        ``media`` holds any) by batch row: one request each in plan order, or the requests
        ``sent`` (``core.groups``: their order and sample counts; counts only where some
        request samples more than once)."""
        spec_of = dict(self.requests())
        order = [EngineRequest(row, 1) for row in spec_of] if sent is None else sent
        rows = [request.row for request in order]
        counts = tuple(request.n for request in order)
        return EngineBatch(
            tuple(prompts[row] for row in rows),
            tuple(spec_of[row] for row in rows),
            tuple(media.get(row) for row in rows) if media else None,
            None if all(n == 1 for n in counts) else counts,
        )


def plan_requests(
    defaults: SamplingDefaults,
    limits: RequestLimits,
    samples: SampleData,
    rows: Sequence[tuple[int, int]],
    *,
    greedy: bool,
    text: bool = False,
) -> Result[RequestPlan, PlanError]:
    """The requests of ``rows``, each ``(batch row, context length)``, in that order (see
    the module docstring). ``text``: the caller reads the completions' text (every row
    detokenizes; otherwise only rows with stop strings)."""
    if bad := [row for row, _ in rows if not 0 <= row < samples.batch_size]:
        raise ValueError(f"rows {bad} are outside a batch of {samples.batch_size}")
    caps = cap_rows(
        limits.max_new_tokens,
        [length for _, length in rows],
        limits.max_model_len,
        cap_to_context=limits.cap_to_context,
        num_speculative_tokens=limits.num_speculative_tokens,
    )
    if isinstance(caps, Failure):
        problem = caps.failure()
        return Failure(PlanError(problem.message, field="max tokens", cause=problem))
    capped = caps.unwrap()
    made: dict[tuple[int, tuple[str, ...], int | None, LoraRef | None], SamplingSpec] = {}
    specs: list[SamplingSpec | None] = []
    for (row, _), cap in zip(rows, capped.max_tokens, strict=True):
        if cap == 0:
            specs.append(None)
            continue
        adapter = samples.adapters[row] if samples.adapters else None
        key = (cap, samples.stops[row], samples.seeds[row], adapter)
        spec = made.get(key)
        if spec is None:  # rows alike share one (immutable) spec
            spec = made[key] = sampling_spec(
                defaults,
                greedy=greedy,
                max_tokens=cap,
                stop=samples.stops[row],
                seed=samples.seeds[row],
                flat_logprobs=limits.flat_logprobs,
                text=text,
            )
            if adapter is not None:
                spec = made[key] = attrs.evolve(spec, adapter=adapter)
        specs.append(spec)
    refused = capped.refused
    if refused is not None:  # name batch rows, not positions in ``rows``
        refused = no_room_error(
            tuple(rows[i][0] for i in refused.rows),
            refused.input_lengths,
            refused.max_model_len,
            refused.reserve,
        )
    return Success(RequestPlan(tuple(row for row, _ in rows), tuple(specs), refused))


def plan_batch(
    config: WorkerConfig,
    caps: EngineCapabilities,
    data: Mapping[str, object],
    batch_size: int,
    rows: Sequence[tuple[int, int]],
    greedy: bool,
    text: bool,
    mode: StopMode,
    served: Mapping[str, int],
) -> Result[RequestPlan, PlanError]:
    """A worker's plan of ``rows`` (:func:`plan_requests`) of a batch of ``batch_size``:
    the per-sample data of ``data`` parsed (:func:`parse_sample_data`: the config's stop
    strings, spread by ``mode``; the adapters among ``served``, NeMo-RL's by default under
    native LoRA), within the limits of ``config`` and the running engine's ``caps``."""
    samples = parse_sample_data(
        data,
        batch_size,
        config_stops=config.stop_strings,
        mode=mode,
        served=served,
        default_adapter=NEMO_RL_ADAPTER_NAME if config.lora.native else None,
    )
    limits = RequestLimits.of(config, caps)
    return samples.bind(lambda s: plan_requests(config, limits, s, rows, greedy=greedy, text=text))


def check_text_prompts(prompts: object) -> Result[tuple[str, ...], PlanError]:
    """``generate_text``'s ``data["prompts"]``: a list of str."""
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        return Failure(
            PlanError("generate_text: data['prompts'] must be a list of str", field="prompts")
        )
    return Success(tuple(prompts))


def check_greedy(greedy: object) -> Result[bool, PlanError]:
    """A generate call's ``greedy``: a bool, not a value that is merely truthy or falsy."""
    if isinstance(greedy, bool):
        return Success(greedy)
    message = f"greedy must be a bool, got {type(greedy).__name__}"
    return Failure(PlanError(message, field="greedy"))


def bos_rows(prompts: Sequence[str], bos: object) -> tuple[list[int], list[int]]:
    """The rows of text ``prompts`` tokenized with the tokenizer's special tokens, and
    those that start with its BOS text ``bos`` already, tokenized without them so that
    they get no second BOS (``bos`` no text, or empty: every row is in the first)."""
    starts = [isinstance(bos, str) and bool(bos) and p.startswith(bos) for p in prompts]
    return [r for r, s in enumerate(starts) if not s], [r for r, s in enumerate(starts) if s]


@attrs.frozen
class TextRefusal(CoreError):
    """Text prompts that cannot generate: ``empty`` ones, or ones whose ids leave no room
    under ``max_model_len`` (``token_counts`` parallel to ``rows``)."""

    rows: tuple[int, ...]
    empty: bool
    token_counts: tuple[int, ...] = ()
    max_model_len: int | None = None

    def row_message(self, row: int) -> str:
        """Why row ``row`` alone is refused (the async worker's per-row error)."""
        if self.empty:
            return f"generate_text: prompt {row} is an empty string"
        count = self.token_counts[self.rows.index(row)]
        return (
            f"generate_text: prompt {row} leaves no room to generate: {count} tokens, "
            f"max_model_len={self.max_model_len} (a prompt must be shorter)"
        )


def text_refusals(
    prompts: Sequence[str], token_counts: Mapping[int, int] | None, max_model_len: int
) -> tuple[TextRefusal, ...]:
    """The prompts that cannot generate: the empty ones, and (given ``token_counts``, the
    ids each non-empty prompt tokenizes to, by row) those with no room for one token;
    empty first, each refusal listing its rows in ascending order."""
    refusals: list[TextRefusal] = []
    if empty := tuple(row for row, p in enumerate(prompts) if not p):
        refusals.append(
            TextRefusal(f"generate_text: prompts {list(empty)} are empty strings", empty, True)
        )
    counts = token_counts or {}
    if long := tuple(sorted(row for row, n in counts.items() if n >= max_model_len)):
        listed = [counts[row] for row in long]
        refusals.append(
            TextRefusal(
                f"generate_text: prompts {list(long)} leave no room to generate: {listed} "
                f"tokens, max_model_len={max_model_len} (a prompt must be shorter)",
                long,
                False,
                tuple(listed),
                max_model_len,
            )
        )
    return tuple(refusals)
