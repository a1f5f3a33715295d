"""genworker's functional core: pure functions over plain values.

No I/O, no clock, no environment, no vLLM/Ray/ZMQ/torch.distributed: whatever the world
knows comes in as an argument, and expected failures come back as ``Result`` values.
"""

from genworker.core.assembly import (
    Generation,
    GenerationOutputs,
    assemble_flat_outputs,
    assemble_outputs,
    flatten_generations,
)
from genworker.core.batch import BatchError, CheckedBatch, check_batch, extract_prompts
from genworker.core.caps import (
    CapArgumentError,
    CapError,
    RowCaps,
    batch_max_tokens,
    cap_rows,
    context_cap,
    request_max_tokens,
    spec_decode_cap,
)
from genworker.core.config import ConfigError, ConfigProblem, VllmConfig, WorkerConfig
from genworker.core.config_keys import KEYS, Fate, KeyRule, check_keys
from genworker.core.counters import (
    decode_snapshot,
    encode_snapshot,
    merge_snapshots,
    spec_decode_metrics,
    step_deltas,
    values_by_name,
)
from genworker.core.delta import (
    DeltaError,
    RelayFailure,
    RelayPlan,
    TensorDelta,
    apply_delta,
    decode_delta,
    encode_delta,
    encode_full,
    plan_relay,
)
from genworker.core.engine_plan import EngineKwargsPlan, plan_engine_kwargs
from genworker.core.errors import CoreError
from genworker.core.lifecycle import Event, LifecycleError, State, check_can_generate, transition
from genworker.core.multimodal import ContextError, MediaError, check_context, check_media
from genworker.core.placement import (
    ClusterPlan,
    EngineEnv,
    PlacementError,
    PlacementPlan,
    configure_worker,
    parse_port_range,
    plan_cluster,
    plan_engine_env,
)
from genworker.core.refit_plan import Manifest, ManifestError, TensorSpec
from genworker.core.refit_protocol import plan_routes, wait_bound
from genworker.core.reshard import (
    ReshardError,
    ReshardPlan,
    TrainerLayout,
    VllmParamFacts,
    plan_reshard,
    vllm_shard,
)
from genworker.core.sampling import SamplingSpec, group_specs, sampling_spec
from genworker.core.sharding import ShardPlan, merge_shard_outputs, plan_shards, split_batch
from genworker.core.stops import StopError, StopMode, merge_stop_strings

__all__ = [
    "KEYS",
    "BatchError",
    "CapArgumentError",
    "CapError",
    "CheckedBatch",
    "ClusterPlan",
    "ConfigError",
    "ConfigProblem",
    "ContextError",
    "CoreError",
    "DeltaError",
    "EngineEnv",
    "EngineKwargsPlan",
    "Event",
    "Fate",
    "Generation",
    "GenerationOutputs",
    "KeyRule",
    "LifecycleError",
    "Manifest",
    "ManifestError",
    "MediaError",
    "PlacementError",
    "PlacementPlan",
    "RelayFailure",
    "RelayPlan",
    "ReshardError",
    "ReshardPlan",
    "RowCaps",
    "SamplingSpec",
    "ShardPlan",
    "State",
    "StopError",
    "StopMode",
    "TensorDelta",
    "TensorSpec",
    "TrainerLayout",
    "VllmConfig",
    "VllmParamFacts",
    "WorkerConfig",
    "apply_delta",
    "assemble_flat_outputs",
    "assemble_outputs",
    "batch_max_tokens",
    "cap_rows",
    "check_batch",
    "check_can_generate",
    "check_context",
    "check_keys",
    "check_media",
    "configure_worker",
    "context_cap",
    "decode_delta",
    "decode_snapshot",
    "encode_delta",
    "encode_full",
    "encode_snapshot",
    "extract_prompts",
    "flatten_generations",
    "group_specs",
    "merge_shard_outputs",
    "merge_snapshots",
    "merge_stop_strings",
    "parse_port_range",
    "plan_cluster",
    "plan_engine_env",
    "plan_engine_kwargs",
    "plan_relay",
    "plan_reshard",
    "plan_routes",
    "plan_shards",
    "request_max_tokens",
    "sampling_spec",
    "spec_decode_cap",
    "spec_decode_metrics",
    "split_batch",
    "step_deltas",
    "transition",
    "values_by_name",
    "vllm_shard",
    "wait_bound",
]
