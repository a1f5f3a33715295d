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
    batch_max_tokens,
    context_cap,
    request_max_tokens,
    spec_decode_cap,
)
from genworker.core.config import ConfigError, ConfigProblem, VllmConfig, WorkerConfig
from genworker.core.counters import (
    decode_snapshot,
    encode_snapshot,
    merge_snapshots,
    spec_decode_metrics,
    step_deltas,
)
from genworker.core.engine_plan import EngineKwargsPlan, plan_engine_kwargs
from genworker.core.errors import CoreError
from genworker.core.lifecycle import (
    Event,
    InflightMode,
    LifecycleError,
    State,
    check_can_generate,
    transition,
)
from genworker.core.placement import (
    ClusterPlan,
    PlacementError,
    PlacementPlan,
    configure_worker,
    plan_cluster,
)
from genworker.core.refit_plan import Manifest, ManifestError, TensorSpec, plan_buckets
from genworker.core.rows import RowChecks, assemble_row, check_rows
from genworker.core.sampling import SamplingSpec, group_specs, sampling_spec
from genworker.core.serving import (
    OffPolicy,
    PrefixMismatch,
    ServerOptions,
    Turn,
    check_on_policy,
    check_turns,
    http_max_tokens,
    server_options,
    splice_prefix,
    training_policy,
)
from genworker.core.sharding import ShardPlan, merge_shard_outputs, plan_shards, split_batch
from genworker.core.stops import StopError, StopMode, merge_stop_strings
from genworker.core.versions import (
    VersionError,
    VersionRuns,
    extend_runs,
    place_versions,
    runs_from_spans,
    runs_from_tokens,
    staleness,
)

__all__ = [
    "BatchError",
    "CapArgumentError",
    "CapError",
    "CheckedBatch",
    "ClusterPlan",
    "ConfigError",
    "ConfigProblem",
    "CoreError",
    "EngineKwargsPlan",
    "Event",
    "Generation",
    "GenerationOutputs",
    "InflightMode",
    "LifecycleError",
    "Manifest",
    "ManifestError",
    "OffPolicy",
    "PlacementError",
    "PlacementPlan",
    "PrefixMismatch",
    "RowChecks",
    "SamplingSpec",
    "ServerOptions",
    "ShardPlan",
    "State",
    "StopError",
    "StopMode",
    "TensorSpec",
    "Turn",
    "VersionError",
    "VersionRuns",
    "VllmConfig",
    "WorkerConfig",
    "assemble_flat_outputs",
    "assemble_outputs",
    "assemble_row",
    "batch_max_tokens",
    "check_batch",
    "check_can_generate",
    "check_on_policy",
    "check_rows",
    "check_turns",
    "configure_worker",
    "context_cap",
    "decode_snapshot",
    "encode_snapshot",
    "extend_runs",
    "extract_prompts",
    "flatten_generations",
    "group_specs",
    "http_max_tokens",
    "merge_shard_outputs",
    "merge_snapshots",
    "merge_stop_strings",
    "place_versions",
    "plan_buckets",
    "plan_cluster",
    "plan_engine_kwargs",
    "plan_shards",
    "request_max_tokens",
    "runs_from_spans",
    "runs_from_tokens",
    "sampling_spec",
    "server_options",
    "spec_decode_cap",
    "spec_decode_metrics",
    "splice_prefix",
    "split_batch",
    "staleness",
    "step_deltas",
    "training_policy",
    "transition",
]
