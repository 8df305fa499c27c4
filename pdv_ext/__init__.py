"""pdv_ext: pipeline + data parallelism for heterogeneous clusters, on DeepSpeed and Horovod.

Public names are imported lazily so that `pdv check-config` and other tools start without DeepSpeed.
"""
#: the one place for the version: pyproject.toml reads it (dynamic version), `pdv --version` prints it
__version__ = "0.1.0"

__all__ = ["initialize", "PDVPipelineEngine", "apply_placement", "build_aggregator", "register_aggregator",
           "TorchComm", "load_pdv", "ConfigError", "exit_on_config_error"]

_LAZY = {
    "initialize": "pdv_ext.integrations.deepspeed",
    "PDVPipelineEngine": "pdv_ext.integrations.deepspeed",
    "apply_placement": "pdv_ext.integrations.deepspeed",
    "build_aggregator": "pdv_ext.aggregation",
    "register_aggregator": "pdv_ext.aggregation",
    "TorchComm": "pdv_ext.comm",
    "load_pdv": "pdv_ext.config",
    "ConfigError": "pdv_ext.config",
    "exit_on_config_error": "pdv_ext.user_errors",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdv_ext' has no attribute '{name}'")
