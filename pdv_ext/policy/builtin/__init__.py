"""Built-in policies (registered on import): goodput, gns_batch_size, straggler_topology, schedule, rebalance, replan."""
from . import gns_batch_size, goodput, rebalance, replan, schedule, straggler_topology  # noqa: F401
