from typing import TypedDict, overload

from ray import ObjectRef

class _PlacementGroupID:
    def hex(self) -> str: ...

class PlacementGroup:
    id: _PlacementGroupID
    def ready(self) -> ObjectRef[object]: ...

def placement_group(
    bundles: list[dict[str, float]],
    strategy: str | None = None,
    name: str = "",
    lifetime: str | None = None,
    _soft_target_node_id: str | None = None,
    bundle_label_selector: list[dict[str, str]] | None = None,
    topology_strategy: dict[str, str] | None = None,
) -> PlacementGroup: ...
class _PlacementGroupInfo(TypedDict):
    placement_group_id: str
    name: str
    bundles: dict[int, dict[str, float]]
    bundles_to_node_id: dict[int, str]
    strategy: str
    state: str
    stats: dict[str, object]

@overload
def placement_group_table(placement_group: PlacementGroup) -> _PlacementGroupInfo: ...
@overload
def placement_group_table(placement_group: None = None) -> dict[str, _PlacementGroupInfo]: ...
def remove_placement_group(placement_group: PlacementGroup) -> None: ...
