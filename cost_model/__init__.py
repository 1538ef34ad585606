"""The cost model the planner calls: hardware (presets, profiles, links per mesh axis), analytical
times (collectives, roofline, FLOPs and bytes per fx node) and per-device memory.

Every quantity carries its unit in its name (`_s`, `_bytes`, `_flops`, `_elems`); each module's
docstring states its formulas.
"""

from cost_model.analytical import (
    NodeCost, collective_time_s, compute_time_s, node_cost, send_bytes,
)
from cost_model.hardware import PRESETS, Cluster, Link, axis_link, default_profile_path, load_cluster
from cost_model.memory import (
    MemoryBytes, activation_bytes, local_numel, model_state_bytes, param_state_bytes, saved_activations,
)

__all__ = [
    "Link", "Cluster", "PRESETS", "load_cluster", "axis_link", "default_profile_path",
    "collective_time_s", "send_bytes", "compute_time_s",
    "NodeCost", "node_cost",
    "MemoryBytes", "local_numel", "param_state_bytes", "model_state_bytes", "saved_activations", "activation_bytes",
]
