"""Data-parallel gradient aggregation: the Aggregator protocol, its registry and the built-ins.

Standalone use in any torch.distributed program::

    from pdv_ext.aggregation import build_aggregator
    from pdv_ext.comm import TorchComm
    out = build_aggregator({"type": "adasum"}).aggregate(tensors, TorchComm())
"""
from .base import AGGREGATORS, Aggregator, build_aggregator, register_aggregator
from .groups import GroupSizeWarning, bind_group
from . import mean  # noqa: F401  (registers built-ins)
from . import adasum  # noqa: F401  (registers built-ins)
from . import robust, suspicion, zeno, gossip  # noqa: F401,E401  (registers built-ins)

__all__ = ["AGGREGATORS", "Aggregator", "GroupSizeWarning", "bind_group", "build_aggregator", "register_aggregator"]
