"""LoRA: the engine's adapter capacity from the config, and an adapter's manifest checked
against what the engine can hold before anything moves (pure values).

Theory of operation
-------------------
**The plan** (:func:`plan_lora`). NeMo-RL turns LoRA on for its vLLM generation worker in
``vllm_kwargs`` (``configure_vllm_lora_refit`` in ``nemo_rl/models/generation/vllm/
lora_utils.py``, NeMo-RL's native-LoRA branch): ``enable_lora``, ``max_lora_rank``,
``max_loras``, ``max_cpu_loras``, ``lora_dtype``, and ``additional_config.nemo_rl_native_lora``
(``{rank, alpha}`` of the trainer's adapter), beside the top-level ``lora_refit_mode``
(``native``: adapter-only refits; ``merged``: the trainer merges and refits the whole
model, which asks the worker for nothing new). Each is honoured or refused by name here;
the engine options vLLM reads (``enable_lora``, ``max_lora_rank``, ``max_loras``,
``max_cpu_loras``, ``lora_dtype``) come out of :meth:`LoraPlan.engine_kwargs`. vLLM's own
checks (``vllm/config/lora.py``, 0.32): ``max_lora_rank`` one of :data:`VLLM_MAX_LORA_RANKS`,
``max_cpu_loras >= max_loras``; both are made here first, so a bad value is refused at load
naming its key instead of as a pydantic error from inside ``vllm.LLM``.

**The adapter** (:func:`check_adapter`). The trainer sends PEFT's tensors as they are in
``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` of shape
``(r, in_features)`` and ``...lora_B.weight`` of ``(out_features, r)`` (vLLM parses them
with ``parse_fine_tuned_lora_name``, ``vllm/lora/utils.py``), with PEFT's
``adapter_config`` (``r``, ``lora_alpha``, ``target_modules``). The check, against
:class:`EngineLora` (the engine's rank limit and the module names its LoRA layers accept),
names every problem at once: a tensor that is not a LoRA A/B weight, a module missing its
A or B, a rank that differs from ``r`` or exceeds the engine's, a module outside
``target_modules`` or outside what the engine adapts, a non-float dtype, and PEFT keys
vLLM would ignore or refuse (``use_dora``, ``modules_to_save``, a ``bias`` other than
``none``, ``rank_pattern`` / ``alpha_pattern``, ``fan_in_fan_out``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.core.refit_protocol import Transport, wait_bound

__all__ = [
    "FLOAT_DTYPES",
    "LORA_KWARGS",
    "NEMO_RL_ADAPTER_NAME",
    "NEMO_RL_NATIVE_KEY",
    "PEFT_INERT_KEYS",
    "REFIT_MODES",
    "VLLM_MAX_LORA_RANKS",
    "Adapter",
    "AdapterError",
    "AdapterModule",
    "EngineLora",
    "LoraPlan",
    "LoraProblem",
    "LoraRef",
    "RowAdapterError",
    "adapter_capacity",
    "adapter_id",
    "adapter_path",
    "adapter_transport",
    "check_adapter",
    "check_adapter_name",
    "lora_update",
    "plan_lora",
    "rank_for",
    "row_adapters",
    "served_adapter_id",
]

VLLM_MAX_LORA_RANKS: Final = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""``max_lora_rank`` values vLLM accepts (``MaxLoRARanks``, vllm/config/lora.py, 0.32)."""

LORA_KWARGS: Final = ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras", "lora_dtype")
"""The ``vllm_kwargs`` keys :func:`plan_lora` reads and :meth:`LoraPlan.engine_kwargs` sets."""

NEMO_RL_NATIVE_KEY: Final = "nemo_rl_native_lora"
"""NeMo-RL's ``vllm_kwargs.additional_config`` entry: ``{rank, alpha}`` of its adapter."""

NEMO_RL_ADAPTER_NAME: Final = "nemo-rl-online"
"""The adapter name NeMo-RL's native LoRA refit serves under."""

REFIT_MODES: Final = ("native", "merged")
"""Values of NeMo-RL's ``lora_refit_mode``."""

LORA_DTYPES: Final = ("auto", "float16", "bfloat16")
FLOAT_DTYPES: Final = frozenset({"float32", "float16", "bfloat16"})

PEFT_INERT_KEYS: Final = frozenset(
    {
        "peft_type",
        "task_type",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "lora_dropout",
        "init_lora_weights",
        "auto_mapping",
        "exclude_modules",
    }
)
"""PEFT ``adapter_config`` keys that change nothing at inference (dropout, init, labels)."""

_PEFT_FALSE_KEYS: Final = ("use_dora", "fan_in_fan_out")
_PEFT_EMPTY_KEYS: Final = (
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
)
_PEFT_OWN_KEYS: Final = ("r", "lora_alpha", "target_modules", "use_rslora", "bias")

_NAME: Final = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")
_ADAPTER_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")


@attrs.frozen
class LoraProblem(CoreError):
    """A LoRA config key refused: which key (its path in the generation config)."""

    key: str = ""


@attrs.frozen
class LoraPlan:
    """The engine's adapter capacity. ``max_cpu_loras`` counts the adapters held at once
    (each name is one), ``max_loras`` those one batch may mix."""

    enabled: bool = False
    max_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int = 1
    dtype: str = "auto"
    native: bool = False  # lora_refit_mode: native (adapter-only refits)
    alpha: float | None = None  # NeMo-RL's native adapter's alpha, the default for refits

    def engine_kwargs(self, *, cpu: bool = False) -> dict[str, object]:
        """The ``vllm.LLM`` kwargs of the plan (none when LoRA is off). ``cpu``: one slot
        more than ``max_loras``, never filled (see :func:`adapter_capacity`)."""
        if not self.enabled:
            return {}
        slots = self.max_loras + cpu
        return {
            "enable_lora": True,
            "max_lora_rank": self.max_rank,
            "max_loras": slots,
            "max_cpu_loras": max(self.max_cpu_loras, slots),
            "lora_dtype": self.dtype,
        }


def adapter_capacity(max_loras: int, max_cpu_loras: int, *, cpu: bool) -> int:
    """How many adapter names an engine started with these vLLM options serves at once.

    vLLM's CPU LoRA kernels (``bgmv_*`` in vllm/lora/ops/torch_ops/lora_ops.py, 0.32) read a
    row without an adapter (slot index -1) from the LAST slot, so on CPU a base-model row
    batched beside an adapter row would run under whatever adapter holds that slot. The
    plan gives a CPU engine one slot more (:meth:`LoraPlan.engine_kwargs`) and serves at
    most ``max_loras - 1`` names there: vLLM activates adapters into the first free slot,
    so with fewer adapters than slots the last one stays zero."""
    return min(max_cpu_loras, max_loras - 1) if cpu else max_cpu_loras


def adapter_id(name: str, ids: Mapping[str, int], capacity: int) -> Result[int, CoreError]:
    """The ``lora_int_id`` adapter ``name`` is served under: its own when it is served
    (``ids``: name -> id), else one past the largest; refused when a new name would
    serve more than ``capacity`` adapters (:func:`adapter_capacity`)."""
    if name in ids:
        return Success(ids[name])
    if len(ids) >= capacity:
        return Failure(
            CoreError(
                f"adapter {name!r} would be adapter {len(ids) + 1}, and this engine serves "
                f"{capacity} (vllm_kwargs.max_cpu_loras, max_loras on CPU); serving "
                f"{sorted(ids)}"
            )
        )
    return Success(max(ids.values(), default=0) + 1)


def rank_for(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank`` (the largest one
    when none does: the adapter check then refuses the rank by name)."""
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), VLLM_MAX_LORA_RANKS[-1])


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _native(additional: object, problems: list[LoraProblem]) -> tuple[int, float] | None:
    """NeMo-RL's ``additional_config.nemo_rl_native_lora``: ``(rank, alpha)``."""
    key = f"vllm_kwargs.additional_config.{NEMO_RL_NATIVE_KEY}"
    raw = additional.get(NEMO_RL_NATIVE_KEY) if isinstance(additional, Mapping) else None
    if raw is None:
        return None
    rank = _positive_int(raw.get("rank")) if isinstance(raw, Mapping) else None
    alpha = raw.get("alpha") if isinstance(raw, Mapping) else None
    if rank is None or isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        problems.append(LoraProblem(f"must be {{rank: int >= 1, alpha: > 0}}, got {raw!r}", key))
        return None
    return rank, float(alpha)


def plan_lora(
    vllm_kwargs: Mapping[str, object], refit_mode: object
) -> Result[LoraPlan, tuple[LoraProblem, ...]]:
    """The LoRA plan of a generation config's ``vllm_kwargs`` and ``lora_refit_mode``
    (``None`` when absent); every refused key named at once."""
    problems: list[LoraProblem] = []
    if refit_mode is not None and refit_mode not in REFIT_MODES:
        problems.append(
            LoraProblem(
                f"must be one of {list(REFIT_MODES)} or null, got {refit_mode!r}", "lora_refit_mode"
            )
        )
    native = _native(vllm_kwargs.get("additional_config"), problems)
    enable = vllm_kwargs.get("enable_lora")
    if enable is not None and not isinstance(enable, bool):
        problems.append(LoraProblem(f"must be a bool, got {enable!r}", "vllm_kwargs.enable_lora"))
    wants = refit_mode == "native" or native is not None
    if enable is False and wants:
        problems.append(
            LoraProblem(
                "is false, but lora_refit_mode: native (or additional_config."
                f"{NEMO_RL_NATIVE_KEY}) asks for adapter refits; set it true or drop it",
                "vllm_kwargs.enable_lora",
            )
        )
    enabled = enable is True or (enable is None and wants)
    ints: dict[str, int | None] = {}
    for key in ("max_lora_rank", "max_loras", "max_cpu_loras"):
        value = vllm_kwargs.get(key)
        ints[key] = _positive_int(value)
        if value is not None and ints[key] is None:
            problems.append(
                LoraProblem(f"must be an int >= 1, got {value!r}", f"vllm_kwargs.{key}")
            )
        elif value is not None and not enabled:
            problems.append(
                LoraProblem(
                    "does nothing without enable_lora: true; set it or drop this key",
                    f"vllm_kwargs.{key}",
                )
            )
    rank = ints["max_lora_rank"] or rank_for(native[0] if native else 16)
    if rank not in VLLM_MAX_LORA_RANKS:
        problems.append(
            LoraProblem(
                f"must be one of {list(VLLM_MAX_LORA_RANKS)} (vLLM's), got {rank}",
                "vllm_kwargs.max_lora_rank",
            )
        )
    if native is not None and native[0] > rank:
        problems.append(
            LoraProblem(
                f"is {rank}, below the trainer's adapter rank {native[0]} "
                f"(additional_config.{NEMO_RL_NATIVE_KEY}.rank)",
                "vllm_kwargs.max_lora_rank",
            )
        )
    max_loras = ints["max_loras"] or 1
    cpu = ints["max_cpu_loras"] or max_loras
    if cpu < max_loras:
        problems.append(
            LoraProblem(
                f"is {cpu}, below max_loras={max_loras} (vLLM needs >=)",
                "vllm_kwargs.max_cpu_loras",
            )
        )
    dtype = vllm_kwargs.get("lora_dtype", "auto")
    if dtype not in LORA_DTYPES:
        problems.append(
            LoraProblem(
                f"must be one of {list(LORA_DTYPES)}, got {dtype!r}", "vllm_kwargs.lora_dtype"
            )
        )
    if problems:
        return Failure(tuple(problems))
    alpha = native[1] if native else None
    return Success(
        LoraPlan(enabled, rank, max_loras, cpu, str(dtype), refit_mode == "native", alpha)
    )


@attrs.frozen
class EngineLora:
    """What an engine's LoRA layers can hold: the rank limit and the module names (the
    last part of a module path, ``q_proj``; a packed layer's parts, as vLLM's
    ``packed_modules_mapping`` lists them) that accept an adapter."""

    max_rank: int
    modules: frozenset[str]
    #: every module path an adapter may name (``model.layers.0.self_attn.q_proj``); empty
    #: when the caller does not know them (then only the names are checked)
    paths: frozenset[str] = frozenset()

    def as_dict(self) -> dict[str, object]:
        return {
            "max_rank": self.max_rank,
            "modules": sorted(self.modules),
            "paths": sorted(self.paths),
        }

    @classmethod
    def of(
        cls,
        max_rank: int,
        supported: Iterable[str],
        paths: Iterable[str],
        packed: Mapping[str, Sequence[str]],
    ) -> EngineLora:
        """What vLLM's LoRA model manager holds: its ``max_lora_rank``, its
        ``supported_lora_modules`` and the paths of its LoRA ``modules``, a packed module
        (``qkv_proj``) standing for its parts (``packed_modules_mapping``)."""
        names = {part for module in supported for part in packed.get(module, [module])}
        unpacked: set[str] = set()
        for path in paths:
            prefix, _, last = path.rpartition(".")
            parts = packed.get(last, [last])
            unpacked.update(f"{prefix}.{part}" if prefix else part for part in parts)
        return cls(max_rank, frozenset(names), frozenset(unpacked))

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> EngineLora:
        rank, modules, paths = raw["max_rank"], raw["modules"], raw.get("paths", ())
        assert isinstance(rank, int)
        assert isinstance(modules, Sequence)
        assert isinstance(paths, Sequence)
        return cls(rank, frozenset(map(str, modules)), frozenset(map(str, paths)))


@attrs.frozen
class AdapterModule:
    """One adapted module: its path (``model.layers.0.self_attn.q_proj``), the features
    its adapter maps, and the names of its A and B tensors."""

    module: str
    in_features: int
    out_features: int
    a: str
    b: str


@attrs.frozen
class AdapterError(CoreError):
    """An adapter the engine cannot hold: every problem, each naming its tensor or key."""

    problems: tuple[str, ...] = ()


@attrs.frozen
class Adapter:
    """An adapter checked against an engine: its tensors (the refit manifest), rank,
    alpha, target module names and adapted modules."""

    manifest: Manifest
    rank: int
    alpha: float
    targets: tuple[str, ...]
    modules: tuple[AdapterModule, ...]
    rslora: bool = False

    def peft_config(self) -> dict[str, object]:
        """The PEFT ``adapter_config`` vLLM's ``PEFTHelper.from_dict`` reads."""
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.targets),
            "use_rslora": self.rslora,
        }


def check_adapter_name(name: object) -> str | None:
    """Why ``name`` cannot name an adapter (None when it can): 1 to 128 characters of
    letters, digits and ``._/-``, not starting with a punctuation mark."""
    if isinstance(name, str) and _ADAPTER_NAME.match(name):
        return None
    return f"an adapter name is 1-128 letters, digits or '._/-' (not first), got {name!r}"


def served_adapter_id(reports: Sequence[object]) -> int | None:
    """The ``lora_int_id`` under which every engine worker's report of an adapter refit
    serves the adapter; None when they disagree or name none."""
    ids = {r.get("lora_int_id") for r in reports if isinstance(r, dict)}
    served = ids.pop() if len(ids) == 1 else None
    return served if isinstance(served, int) else None


def lora_update(
    name: object, timeout_s: object, transport: object
) -> Result[tuple[float, Transport], CoreError]:
    """``update_lora``'s arguments, checked in this order: the adapter's name, ``timeout_s``
    (the bound of each wait, ``core.refit_protocol.wait_bound``) and the transport."""
    if (problem := check_adapter_name(name)) is not None:
        return Failure(AdapterError(problem))
    bound = wait_bound(timeout_s)
    if isinstance(bound, Failure):
        return bound
    return adapter_transport(transport).map(lambda known: (bound.unwrap(), known))


def adapter_transport(transport: object) -> Result[Transport, AdapterError]:
    """The transport an adapter refit arrives over, named by its value."""
    known = {t.value: t for t in Transport}
    if not isinstance(transport, str) or transport not in known:
        message = f"transport must be one of {sorted(known)}, got {transport!r}"
        return Failure(AdapterError(message))
    return Success(known[transport])


def _peft_problems(peft: Mapping[str, object]) -> list[str]:
    problems = [
        f"adapter_config.{key}={peft[key]!r} is not supported (vLLM serves plain LoRA); leave it false"
        for key in _PEFT_FALSE_KEYS
        if peft.get(key)
    ]
    problems += [
        f"adapter_config.{key}={peft[key]!r} is not supported (every module gets rank r on every layer)"
        for key in _PEFT_EMPTY_KEYS
        if peft.get(key)
    ]
    if peft.get("bias", "none") != "none":
        problems.append(
            f"adapter_config.bias={peft['bias']!r} is not supported; train with bias='none'"
        )
    known = PEFT_INERT_KEYS | set(_PEFT_FALSE_KEYS) | set(_PEFT_EMPTY_KEYS) | set(_PEFT_OWN_KEYS)
    problems += [
        f"adapter_config.{key} is not a PEFT LoRA key genworker knows"
        for key in sorted(set(peft) - known)
    ]
    return problems


def _targets(peft: Mapping[str, object], problems: list[str]) -> tuple[str, ...]:
    raw = peft.get("target_modules")
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, Sequence) or not raw or not all(isinstance(t, str) and t for t in raw):
        problems.append(
            f"adapter_config.target_modules must be a non-empty list of module names, got {raw!r}"
        )
        return ()
    return tuple(sorted({str(t) for t in raw}))


def _pairs(manifest: Manifest, problems: list[str]) -> dict[str, dict[str, TensorSpec]]:
    """Each module's A and B specs by module path."""
    halves: dict[str, dict[str, TensorSpec]] = {}
    for spec in manifest.specs:
        match = _NAME.match(spec.name)
        if match is None:
            problems.append(
                f"tensor {spec.name!r} is not a LoRA weight (<module>.lora_A.weight or .lora_B.weight)"
            )
            continue
        if spec.dtype not in FLOAT_DTYPES:
            problems.append(
                f"tensor {spec.name!r} is {spec.dtype}; adapters travel as {sorted(FLOAT_DTYPES)}"
            )
        halves.setdefault(match["module"], {})[match["half"]] = spec
    return halves


def _module(
    path: str, half: Mapping[str, TensorSpec], rank: int, problems: list[str]
) -> AdapterModule | None:
    a, b = half.get("A"), half.get("B")
    if a is None or b is None:
        has, lacks = ("A", "B") if a else ("B", "A")
        problems.append(f"module {path!r} has lora_{has}.weight but no lora_{lacks}.weight")
        return None
    if len(a.shape) != 2 or len(b.shape) != 2:
        problems.append(
            f"module {path!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} must be 2-D"
        )
        return None
    if a.shape[0] != rank or b.shape[1] != rank:
        problems.append(
            f"module {path!r}: lora_A {list(a.shape)} must be (r, in) and lora_B {list(b.shape)} "
            f"(out, r) with r={rank} (adapter_config.r)"
        )
        return None
    return AdapterModule(path, a.shape[1], b.shape[0], a.name, b.name)


def check_adapter(
    manifest: Manifest,
    peft: Mapping[str, object],
    engine: EngineLora,
    *,
    alpha: float | None = None,
) -> Result[Adapter, AdapterError]:
    """``manifest`` (the adapter's tensors) with ``peft`` (its ``adapter_config``) checked
    against ``engine``; ``alpha`` is the default when ``peft`` gives no ``lora_alpha``."""
    problems = _peft_problems(peft)
    rank = _positive_int(peft.get("r"))
    if rank is None:
        problems.append(f"adapter_config.r must be an int >= 1, got {peft.get('r')!r}")
    elif rank > engine.max_rank:
        problems.append(
            f"adapter_config.r={rank} exceeds the engine's max_lora_rank={engine.max_rank}; "
            f"start it with vllm_kwargs.max_lora_rank: {rank_for(rank)}"
        )
    given = peft.get("lora_alpha", alpha)
    if isinstance(given, bool) or not isinstance(given, int | float) or given <= 0:
        problems.append(f"adapter_config.lora_alpha must be a number > 0, got {given!r}")
    rslora = peft.get("use_rslora", False)
    if not isinstance(rslora, bool):
        problems.append(f"adapter_config.use_rslora must be a bool, got {rslora!r}")
    targets = _targets(peft, problems)
    if unheld := sorted(set(targets) - engine.modules):
        problems.append(
            f"adapter_config.target_modules {unheld} are not modules this engine adapts "
            f"(it adapts {sorted(engine.modules)})"
        )
    modules: list[AdapterModule] = []
    for path, half in sorted(_pairs(manifest, problems).items()):
        name = path.rpartition(".")[2]
        if engine.paths and path not in engine.paths:
            problems.append(f"module {path!r} is not a module of this engine's model")
        if name not in targets:
            problems.append(
                f"module {path!r} is not in adapter_config.target_modules {list(targets)}"
            )
        module = _module(path, half, rank or 0, problems) if rank else None
        modules.extend([module] if module else [])
    if problems:
        summary = f"the adapter cannot be served: {len(problems)} problem(s): " + "; ".join(
            problems
        )
        return Failure(AdapterError(summary, tuple(problems)))
    assert rank is not None
    assert isinstance(given, int | float)
    return Success(Adapter(manifest, rank, float(given), targets, tuple(modules), bool(rslora)))


@attrs.frozen
class LoraRef:
    """A request's adapter: its name and the engine's ``lora_int_id`` for it."""

    name: str
    lora_int_id: int


def adapter_path(name: str) -> str:
    """The ``lora_path`` of a request for adapter ``name``. vLLM's worker never reads it
    (the adapter is registered under its id by the refit), but its prefix cache keys
    blocks by name and path (``_gen_lora_extra_hash_keys``, vllm/v1/core/kv_cache_utils.py)."""
    return f"genworker-lora://{name}"


@attrs.frozen
class RowAdapterError(CoreError):
    """A batch's adapter names refused: which input (``lora`` or ``lora_names``)."""

    field: str = "lora"


def row_adapters(
    lora: object,
    lora_names: object,
    batch_size: int,
    served: Mapping[str, int],
    default: str | None = None,
) -> Result[tuple[LoraRef | None, ...], RowAdapterError]:
    """Each row's adapter: ``lora`` (one name for the batch) or ``lora_names`` (one name
    or None per row), each a name in ``served`` (name -> ``lora_int_id``); neither given:
    ``default`` once it is served (NeMo-RL's native mode serves every request under its
    one adapter), else every row on the base model (an empty tuple)."""
    if lora is None and lora_names is None and default in served:
        lora = default
    if lora is not None and lora_names is not None:
        return Failure(
            RowAdapterError("give lora (the batch's adapter) or lora_names (per row), not both")
        )
    if lora is None and lora_names is None:
        return Success(())
    field = "lora" if lora is not None else "lora_names"
    names = [lora] * batch_size if lora is not None else lora_names
    if not isinstance(names, list | tuple) or len(names) != batch_size:
        return Failure(
            RowAdapterError(
                f"lora_names must be a list of {batch_size} names or None, got {names!r}", field
            )
        )
    if unknown := sorted(
        {repr(n) for n in names if n is not None and (not isinstance(n, str) or n not in served)}
    ):
        return Failure(
            RowAdapterError(
                f"{field}: no adapter {', '.join(unknown)} is served here (served: {sorted(served)}); "
                "refit one first (update_lora)",
                field,
            )
        )
    return Success(tuple(None if n is None else LoraRef(n, served[n]) for n in names))
