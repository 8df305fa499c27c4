"""`pdv_ext.horovod`: the Horovod entry points (implementation in `pdv_ext.integrations.horovod`).

    import pdv_ext.horovod as pdv_hvd
    optimizer = pdv_hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             aggregation="adasum")
"""
from .comm.horovod_comm import HorovodComm
from .integrations.horovod import (DistributedOptimizer, HorovodApplier, PolicyHook, register_elastic_handlers,
                                   resolve_aggregation)

__all__ = ["DistributedOptimizer", "HorovodApplier", "HorovodComm", "PolicyHook", "register_elastic_handlers", "resolve_aggregation"]
