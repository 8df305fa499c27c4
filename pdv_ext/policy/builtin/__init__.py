"""Built-in policies (registered on import): gns_batch_size, straggler_topology, schedule."""
from . import gns_batch_size, schedule, straggler_topology  # noqa: F401
