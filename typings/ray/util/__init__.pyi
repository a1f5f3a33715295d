from ray.util import placement_group as placement_group_module
from ray.util import scheduling_strategies as scheduling_strategies
from ray.util.placement_group import placement_group_table as placement_group_table

def get_node_ip_address(address: str | None = None) -> str: ...
