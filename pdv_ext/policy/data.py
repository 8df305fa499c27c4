"""A data iterator whose position survives batch-size changes, data-share changes and checkpoints.

The training stream is the concatenation of per-epoch permutations of the dataset (epoch e shuffled
with seed `seed * 1000003 + e`): stream position i is sample `perm_e[i mod N]`, e = i // N. A step takes
the next M micro-batches of the stream (M x mbs positions) and hands them to the replicas in turn: slot
k of the step goes to the k-th replica in the order (round 0: replicas 0..dp-1, round 1: ..., skipping a
replica whose share is used up). With equal shares (n micro-batches each, M = n x dp) the j-th
micro-batch that replica d pulls since the last re-base covers positions `base + (j * dp + d) * mbs` up to
`+ mbs`; with data shares n_d (micro-batches per replica, summing to M) replica d's j-th micro-batch of a
step is the slot of round j, after the replicas before d that still take one in that round and every
replica's micro-batches of the earlier rounds. Either way after each step `base + steps x M x mbs` is the
global position on every rank. Changing the micro-batch size or the shares re-bases at the current
position: no position is skipped or read twice, so within an epoch every sample is seen exactly once
whatever the batch sizes and shares were (micro-batches may straddle epochs). The first and the last
pipeline stage of a replica each hold one iterator; they stay in step.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch


class ElasticBatches:
    """Resumable micro-batch iterator. `dataset` is a tuple of tensors indexed on dim 0 (like
    TensorDataset), an object with `fetch(indices) -> batch`, or any indexable of (x, y) samples."""

    def __init__(self, dataset: Any, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 shuffle: bool = True, collate: Optional[Callable[[List[Any]], Any]] = None,
                 record: bool = False):
        self.dataset = dataset
        self.n = len(dataset[0]) if isinstance(dataset, (tuple, list)) and torch.is_tensor(dataset[0]) else len(dataset)
        if self.n == 0:
            raise ValueError("ElasticBatches: empty dataset")
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.seed, self.shuffle, self.collate = seed, shuffle, collate
        self.base = 0  # global stream position at the last re-base
        self.pulled = 0  # micro-batches this replica pulled since the last re-base
        #: micro-batches per replica and step when the data shares are unequal (None: equal)
        self.shares: Optional[List[int]] = None
        self._perms: Dict[int, torch.Tensor] = {}
        #: stream positions handed out (for tests that count samples); off by default
        self.record = record
        self.seen: List[int] = []

    @classmethod
    def for_engine(cls, engine: Any, dataset: Any, seed: int = 0, **kwargs: Any) -> "ElasticBatches":
        """An iterator matching a DeepSpeed engine's micro-batch size and this rank's replica."""
        it = cls(dataset, engine.train_micro_batch_size_per_gpu(), engine.grid.get_data_parallel_id(),
                 engine.grid.get_data_parallel_world_size(), seed=seed, **kwargs)
        it.set_shares(getattr(engine, "data_shares", None))
        return it

    # ---- position --------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Global stream position after the micro-batches pulled so far (exact at step boundaries)."""
        if self.shares is None:
            return self.base + self.pulled * self.dp_size * self.micro_batch_size
        steps = self.pulled // self.shares[self.dp_rank]
        return self.base + steps * sum(self.shares) * self.micro_batch_size

    @property
    def epoch(self) -> int:
        return self.position // self.n

    def set_micro_batch_size(self, size: int) -> None:
        """Re-base at the current position (call at a step boundary, on every rank)."""
        self.base = self.position
        self.pulled = 0
        self.micro_batch_size = int(size)

    def set_shares(self, shares: Optional[Sequence[int]]) -> None:
        """Micro-batches per replica and step from now on (None or equal: the plain interleaving); re-bases
        at the current position (call at a step boundary, on every rank, with the same shares)."""
        if shares is not None:
            shares = [int(n) for n in shares]
            if len(shares) != self.dp_size or min(shares) < 1:
                raise ValueError(f"ElasticBatches.set_shares: need {self.dp_size} counts >= 1, got {shares}")
            if len(set(shares)) == 1:
                shares = None
        self.base = self.position
        self.pulled = 0
        self.shares = shares

    def set_replica(self, dp_rank: int, dp_size: int) -> None:
        """Serve replica `dp_rank` of `dp_size` from the current position on (a move gave this rank another
        place; call at a step boundary, on every rank, after `load_state_dict` of the position). The data
        shares go back to the equal split: they were per replica of the old plan."""
        self.base = self.position
        self.pulled = 0
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.shares = None

    def state_dict(self) -> Dict[str, Any]:
        return {"position": self.position, "micro_batch_size": self.micro_batch_size, "seed": self.seed,
                "shares": None if self.shares is None else list(self.shares)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.base, self.pulled = int(state["position"]), 0
        self.micro_batch_size = int(state["micro_batch_size"])
        self.shares = list(state["shares"]) if state.get("shares") is not None else None
        self._perms.clear()

    def _slot(self, pulled: int) -> int:
        """Micro-batch slot (from `base`) of this replica's `pulled`-th micro-batch since the re-base."""
        if self.shares is None:
            return pulled * self.dp_size + self.dp_rank
        n_me = self.shares[self.dp_rank]
        step, j = divmod(pulled, n_me)
        before = sum(min(n, j) for n in self.shares)  # every replica's micro-batches of rounds 0..j-1
        before += sum(1 for n in self.shares[: self.dp_rank] if n > j)  # round j, replicas before this one
        return step * sum(self.shares) + before

    # ---- iteration -------------------------------------------------------------------------------
    def _perm(self, epoch: int) -> torch.Tensor:
        p = self._perms.get(epoch)
        if p is None:
            if self.shuffle:
                p = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
            else:
                p = torch.arange(self.n)
            self._perms = {e: v for e, v in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = p
        return p

    def indices(self, start: int, count: int) -> torch.Tensor:
        """Sample indices of stream positions start .. start+count-1."""
        pos = torch.arange(start, start + count)
        epochs = pos // self.n
        out = torch.empty(count, dtype=torch.long)
        for e in epochs.unique().tolist():
            m = epochs == e
            out[m] = self._perm(int(e))[pos[m] % self.n]
        return out

    def __iter__(self) -> "ElasticBatches":
        return self

    def __next__(self) -> Any:
        mbs = self.micro_batch_size
        start = self.base + self._slot(self.pulled) * mbs
        self.pulled += 1
        if self.record:
            self.seen.extend(range(start, start + mbs))
        return self.fetch(self.indices(start, mbs))

    def fetch(self, idx: torch.Tensor) -> Any:
        ds = self.dataset
        if isinstance(ds, (tuple, list)) and torch.is_tensor(ds[0]):
            return tuple(t[idx] for t in ds)
        if hasattr(ds, "fetch"):
            return ds.fetch(idx)
        items = [ds[int(i)] for i in idx]
        if self.collate is not None:
            return self.collate(items)
        return tuple(torch.stack([torch.as_tensor(it[k]) for it in items]) for k in range(len(items[0])))


class TextWindows:
    """Non-overlapping (input, next-byte target) windows of a byte string: a finite dataset with epochs.
    Sample i is bytes [i*L, i*L + L] (L = seq_len)."""

    def __init__(self, data: bytes, seq_len: int):
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def fetch(self, idx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = self.data[idx[:, None] * self.seq_len + torch.arange(self.seq_len + 1)]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
