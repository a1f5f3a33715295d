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
from genworker.core.lifecycle import Event, LifecycleError, State, check_can_generate, transition
from genworker.core.placement import (
    ClusterPlan,
    PlacementError,
    PlacementPlan,
    configure_worker,
    plan_cluster,
)
from genworker.core.refit_plan import Manifest, ManifestError, TensorSpec
from genworker.core.refit_protocol import plan_routes, wait_bound
from genworker.core.sampling import SamplingSpec, group_specs, sampling_spec
from genworker.core.sharding import ShardPlan, merge_shard_outputs, plan_shards, split_batch
from genworker.core.stops import StopError, StopMode, merge_stop_strings

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
    "LifecycleError",
    "Manifest",
    "ManifestError",
    "PlacementError",
    "PlacementPlan",
    "SamplingSpec",
    "ShardPlan",
    "State",
    "StopError",
    "StopMode",
    "TensorSpec",
    "VllmConfig",
    "WorkerConfig",
    "assemble_flat_outputs",
    "assemble_outputs",
    "batch_max_tokens",
    "check_batch",
    "check_can_generate",
    "configure_worker",
    "context_cap",
    "decode_snapshot",
    "encode_snapshot",
    "extract_prompts",
    "flatten_generations",
    "group_specs",
    "merge_shard_outputs",
    "merge_snapshots",
    "merge_stop_strings",
    "plan_cluster",
    "plan_engine_kwargs",
    "plan_routes",
    "plan_shards",
    "request_max_tokens",
    "sampling_spec",
    "spec_decode_cap",
    "spec_decode_metrics",
    "split_batch",
    "step_deltas",
    "transition",
    "wait_bound",
]
