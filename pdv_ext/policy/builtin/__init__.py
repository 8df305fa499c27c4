"""Built-in policies (registered on import): gns_batch_size, straggler_topology, schedule, rebalance."""
from . import gns_batch_size, rebalance, schedule, straggler_topology  # noqa: F401
