"""`pdv_ext.horovod`: the Horovod entry points (implementation in `pdv_ext.integrations.horovod`).

    import pdv_ext.horovod as pdv_hvd
    optimizer = pdv_hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             aggregation="adasum")

The Comm over Horovod lives with the other Comms: `from pdv_ext.comm import HorovodComm`.
`pdv_ext.horovod.HorovodComm` still works but is deprecated (a DeprecationWarning names the new path).
"""
import warnings

from .integrations.horovod import (DistributedOptimizer, HorovodApplier, PolicyHook, register_elastic_handlers,
                                   resolve_aggregation)

__all__ = ["DistributedOptimizer", "HorovodApplier", "PolicyHook", "register_elastic_handlers", "resolve_aggregation"]


def __getattr__(name):
    if name == "HorovodComm":
        warnings.warn("pdv_ext.horovod.HorovodComm is deprecated; import it from pdv_ext.comm "
                      "(from pdv_ext.comm import HorovodComm)", DeprecationWarning, stacklevel=2)
        from .comm import HorovodComm

        return HorovodComm
    raise AttributeError(f"module 'pdv_ext.horovod' has no attribute '{name}'")
