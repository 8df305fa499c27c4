"""Adaptive policy layer: the Monitor (cheap per-step metrics), the Policy API and its Actions, and the
PolicyRunner that makes every rank apply the same actions at the same step. See docs/policy.md."""
from .base import (POLICIES, Action, Change, Policy, SetAggregator, SetBatchSize, SetDataShares, SetGossipPeers,
                   SetLearningRate, TrainContext, build_policy, register_policy)
from . import builtin  # noqa: F401,E402  (registers the built-in policies, as aggregation/ does its aggregators)

__all__ = ["POLICIES", "Action", "Change", "Policy", "SetAggregator", "SetBatchSize", "SetDataShares", "SetGossipPeers",
           "SetLearningRate", "TrainContext", "build_policy", "register_policy", "Monitor", "PolicyRunner",
           "ElasticBatches"]


def __getattr__(name):  # torch-heavy parts load on first use
    if name == "Monitor":
        from .metrics import Monitor

        return Monitor
    if name == "PolicyRunner":
        from .runner import PolicyRunner

        return PolicyRunner
    if name == "ElasticBatches":
        from .data import ElasticBatches

        return ElasticBatches
    raise AttributeError(name)
