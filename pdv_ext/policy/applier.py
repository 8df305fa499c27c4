"""What every framework's applier does the same way (the runner's actions on a live training loop).

DeepSpeed's applier (pdv_ext.integrations.deepspeed.glue.EngineApplier) and Horovod's
(pdv_ext.integrations.horovod.HorovodApplier) differ in where the batch geometry and the shares live; the
LR, the gossip peers and how the data iterator follows a new split or micro-batch size are the same.
"""
from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence


class ApplierBase:
    """A framework's applier supplies `optimizer`, `aggregator` and `data_iterator` (properties)."""

    @property
    def optimizer(self) -> Any:
        raise NotImplementedError

    @property
    def aggregator(self) -> Any:
        raise NotImplementedError

    @property
    def data_iterator(self) -> Any:
        raise NotImplementedError

    def get_lr(self) -> List[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def set_lr(self, lrs: Sequence[float]) -> None:
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr

    def set_gossip_peers(self, peers: int) -> None:
        agg = self.aggregator
        if not hasattr(agg, "set_peers"):
            raise ValueError(f"SetGossipPeers: the aggregator '{agg.name}' has no peers (switch to gossip first)")
        agg.set_peers(peers)

    def iterator_follows_shares(self, shares: Optional[Sequence[int]]) -> None:
        """The data iterator reads its replica's slice of the new split (ElasticBatches.set_shares)."""
        it = self.data_iterator
        if hasattr(it, "set_shares"):
            it.set_shares(shares)
        elif it is not None:
            warnings.warn("data shares changed but the data iterator cannot follow: use "
                          "pdv_ext.policy.data.ElasticBatches so that every replica reads its own slice of the "
                          "global batch (no sample lost or repeated)")

    def iterator_follows_micro_batch_size(self, size: int) -> None:
        it = self.data_iterator
        if hasattr(it, "set_micro_batch_size"):
            it.set_micro_batch_size(size)
        elif it is not None:
            warnings.warn("the micro-batch size changed but the data iterator cannot follow: use "
                          "pdv_ext.policy.data.ElasticBatches so that no sample is lost or repeated")
