"""NeMo-RL's names and shapes at the drop-ins' edge (``shell/nemo_rl.py``,
``shell/nemo_rl_async.py``): what both fronts translate, over plain values.

* :func:`nemo_rl_outputs`: a genworker ``generate`` result as NeMo-RL's
  ``GenerationOutputSpec`` (genworker's ``weight_versions`` left out: NeMo-RL merges the
  workers' outputs with ``BatchedDataDict.from_batches``, which would pad it with 0, a
  version), with ``routed_experts`` in NeMo-RL's layout when the worker returned routes.
* :func:`raw_spec_counters`: the engine's encoded metric snapshot keyed by metric name,
  as NeMo-RL's ``_get_raw_spec_counters`` returns it.
* :func:`wake_up_tags`: NeMo-RL's ``wake_up(**kwargs)`` takes ``tags=`` only.
* :func:`reported_url`: the OpenAI server's URL as NeMo-RL reports it.
* :func:`sampling_params` / :func:`with_sampling`: ``update_sampling_params`` (NeMo-RL
  #2538) replaces only :data:`SAMPLING_KEYS`, checked as the config is.
* :data:`REFUSED` / :func:`refusal`: the methods of NeMo-RL's async worker that genworker's
  async drop-in has but cannot do, each refused naming what it asks for and what to do
  instead (never a silent no-op).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import attrs
import torch
from returns.result import Failure, Result, Success

from genworker.core.config import ConfigError, WorkerConfig
from genworker.core.counters import (
    CACHE_RESETS,
    NONFINITE_LOGPROBS,
    CounterError,
    decode_snapshot,
    values_by_name,
)
from genworker.core.errors import CoreError
from genworker.core.routing import nemo_rl_routes

__all__ = [
    "NEMO_RL_OUTPUT_KEYS",
    "REFUSED",
    "ROUTED_EXPERTS",
    "SAMPLING_KEYS",
    "WakeUpError",
    "nemo_rl_outputs",
    "raw_spec_counters",
    "refusal",
    "reported_url",
    "sampling_params",
    "wake_up_tags",
    "with_sampling",
]

#: NeMo-RL's ``GenerationOutputSpec``: the keys of every ``generate`` result
NEMO_RL_OUTPUT_KEYS: Final = (
    "output_ids",
    "logprobs",
    "generation_lengths",
    "unpadded_sequence_lengths",
    "truncated",
)

#: NeMo-RL's key for the routes of MoE routing replay (PR #2590), present only when the
#: worker returns them (``enable_return_routed_experts``)
ROUTED_EXPERTS: Final = "routed_experts"

#: the config keys ``update_sampling_params`` may replace
SAMPLING_KEYS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "stop_token_ids",
    "stop_strings",
    "bad_words",
    "ignore_eos",
)


def nemo_rl_outputs(out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``out`` with NeMo-RL's keys, and ``routed_experts`` in NeMo-RL's layout
    (``core.routing.nemo_rl_routes``: positions without a route hold ``arange(top_k)``,
    not genworker's -1) when ``out`` has routes."""
    spec = {key: out[key] for key in NEMO_RL_OUTPUT_KEYS}
    routes = out.get(ROUTED_EXPERTS)
    if routes is not None:
        spec[ROUTED_EXPERTS] = torch.from_numpy(nemo_rl_routes(routes.numpy()))
    return spec


def raw_spec_counters(
    encoded: Mapping[str, float | list[float]],
) -> Result[dict[str, float | list[float]], CounterError]:
    """A worker's ``get_counters()`` keyed by metric name. The worker's own counters
    (``genworker:cache_resets``, one series per cache; ``genworker:nonfinite_logprobs``,
    one per kind) are left out: summed by name they would mean nothing."""
    own = {CACHE_RESETS, NONFINITE_LOGPROBS}
    return decode_snapshot(encoded).map(
        lambda snapshot: values_by_name(s for s in snapshot.samples if s.name not in own)
    )


@attrs.frozen
class WakeUpError(CoreError):
    """``wake_up`` was given a keyword other than ``tags``, or tags that are no list."""


def wake_up_tags(
    call: str, kwargs: Mapping[str, object]
) -> Result[Sequence[str] | None, WakeUpError]:
    """The ``tags=`` of ``call``'s keywords; any other keyword is refused by name (the
    worker checks the entries)."""
    unknown = sorted(set(kwargs) - {"tags"})
    if unknown:
        return Failure(WakeUpError(f"{call} takes only tags=, got {unknown}"))
    tags = kwargs.get("tags")
    if tags is not None and not isinstance(tags, Sequence):
        return Failure(WakeUpError(f"{call} tags must be a list of str or None, got {tags!r}"))
    return Success(tags)


_EVERY_INTERFACE: Final = frozenset({"0.0.0.0", "::"})


def reported_url(url: str | None, node_address: Callable[[], str]) -> str | None:
    """The server's URL as NeMo-RL reports it: a server listening on every interface is
    reached at this node's address (``node_address()``, asked only then); any other URL
    is as bound."""
    if url is None:
        return None
    parts = urllib.parse.urlsplit(url)
    if parts.hostname not in _EVERY_INTERFACE:
        return url
    ip = node_address()
    host = f"[{ip}]" if ":" in ip else ip
    return parts._replace(netloc=f"{host}:{parts.port}").geturl()


def sampling_params(params: Mapping[str, object]) -> Result[Mapping[str, object], CoreError]:
    """``update_sampling_params``'s keywords: names outside :data:`SAMPLING_KEYS` are
    refused, naming them."""
    unknown = sorted(set(params) - set(SAMPLING_KEYS))
    if unknown:
        return Failure(
            CoreError(f"update_sampling_params takes only {list(SAMPLING_KEYS)}, got {unknown}")
        )
    return Success(params)


def with_sampling(
    cfg: WorkerConfig, params: Mapping[str, object]
) -> Result[WorkerConfig, ConfigError]:
    """``cfg`` with the keys ``params`` names (:func:`sampling_params`) taking its values,
    validated as every config is."""
    merged = cfg.to_mapping()
    merged.update(params)
    return WorkerConfig.from_mapping(merged)


_REFITS: Final = (
    "refit with update_weights_via_ipc_zmq_async or update_weights_from_collective_async"
)
_RESHARD: Final = ("NeMo-RL's nccl_reshard refit", _REFITS)
_RELAY: Final = ("NeMo-RL's sparse refit relay", f"set refit_transport: null and {_REFITS}")
_CAPTURE: Final = (
    "NeMo-RL's token capture (#3837)",
    "leave token_capture.enabled false (NeMo-Gym's token-echo path): every row genworker "
    "returns carries its token ids, logprobs and weight_versions",
)
_NSIGHT: Final = (
    "nsight profiling of the async engine",
    "unset NRL_NSYS_PROFILE_STEP_RANGE, or profile with the synchronous worker "
    "(vllm_cfg.async_engine: false)",
)

#: The async drop-in's methods that refuse (NeMo-RL's async worker has them, genworker
#: cannot do them): what each asks for (``{}``: the call's argument that names it) and
#: what to do instead, the refusal's two halves (:func:`refusal`)
REFUSED: Final[Mapping[str, tuple[str, str]]] = {
    "init_nccl_reshard_comm_group_async": _RESHARD,
    "prepare_nccl_reshard_refit_info_async": _RESHARD,
    "nccl_reshard_refit_async": _RESHARD,
    "checkpoint_engine_rpc_async": (
        "the checkpoint engine ({})",
        f"leave checkpoint_engine unset and {_REFITS}",
    ),
    "start_zmq_sparse_refit_relay": _RELAY,
    "configure_zmq_sparse_refit_relay": _RELAY,
    "stop_zmq_sparse_refit_relay": _RELAY,
    "setup_token_capture": _CAPTURE,
    "install_token_capture": _CAPTURE,
    "set_rollout_weight_version": (
        _CAPTURE[0],
        _CAPTURE[1] + "; genworker counts weight versions itself (one per good refit)",
    ),
    "start_gpu_profiling": _NSIGHT,
    "stop_gpu_profiling": _NSIGHT,
}


def refusal(method: str, *named: object) -> str:
    """Why ``method`` (a key of :data:`REFUSED`) is refused and what to do instead;
    ``named``: what the call named, put in the ``{}`` of what it asks for."""
    what, instead = REFUSED[method]
    return f"{method}: {what.format(*named)} is not supported by genworker's drop-in; {instead}"
