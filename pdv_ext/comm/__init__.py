"""Communication adapters: one `Comm` protocol, one implementation per framework.

`from pdv_ext.comm import HorovodComm` is the one import path of the Horovod Comm (imported lazily: it
needs Horovod, which most users never do).
"""
from .base import Comm, LocalComm
from .torch_comm import TorchComm, host_twin, world_comm

__all__ = ["Comm", "LocalComm", "TorchComm", "HorovodComm", "host_twin", "world_comm"]


def __getattr__(name):  # HorovodComm imports horovod lazily: most users never need it
    if name == "HorovodComm":
        from .horovod_comm import HorovodComm

        return HorovodComm
    raise AttributeError(f"module 'pdv_ext.comm' has no attribute '{name}'")
