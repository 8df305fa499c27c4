"""Small models and data used by the demo, the benchmarks and the tests.

- `gpt_layers`: a GPT-style byte-level language model as a list of LayerSpecs (embedding, transformer
  blocks, head), trained on CPython's own documentation text (`pydoc_data.topics`, ships with Python).
- `mlp_layers`: a stack of Linear+ReLU blocks, the cheapest real pipeline model.
- `digits_data`: scikit-learn's handwritten digits, for classification.
- `TeacherSamples` / `teacher_layers`: regression on a noisy linear teacher, a task with a known noise floor
  (the held-out loss against the clean targets is the excess loss, zero at the optimum).
"""
from __future__ import annotations

import math
from typing import Iterator, Tuple

import torch
from torch import nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------------
# GPT-style byte-level language model
# ---------------------------------------------------------------------------------------------------
class Embed(nn.Module):
    """Token + learned position embedding: (B, T) int64 -> (B, T, H)."""

    def __init__(self, vocab: int, hidden: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.zeros(seq_len, hidden))
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, hidden: int, heads: int, ffn_mult: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn_mult * hidden)
        self.fc2 = nn.Linear(ffn_mult * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm + projection to byte logits."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt_layers(layers: int = 4, hidden: int = 128, heads: int = 4, seq_len: int = 64, vocab: int = 256) -> list:
    """LayerSpecs of the byte-level GPT: [Embed, Block x layers, Head]."""
    from deepspeed.pipe import LayerSpec

    return ([LayerSpec(Embed, vocab, hidden, seq_len)] + [LayerSpec(Block, hidden, heads) for _ in range(layers)]
            + [LayerSpec(Head, hidden, vocab)])


def doc_text() -> bytes:
    """CPython's documentation topics as one byte string (about 465 KB of English), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


class TextWindows:
    """Every (input, next-byte target) window of a byte string, as an indexable dataset: sample i is bytes
    [i, i + seq_len] (`fetch(indices)` for a whole batch, what `ElasticBatches` asks of a dataset)."""

    def __init__(self, data: bytes, seq_len: int):
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return len(self.data) - self.seq_len - 1

    def fetch(self, idx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = self.data[idx[:, None] + self.offsets]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class ByteWindows:
    """Random (input, next-byte target) windows from a byte string, seeded and resumable.

    `position` counts the windows handed out so far; a checkpoint saves it, and a resumed stream
    continues exactly where it stopped.
    """

    def __init__(self, data: bytes, seq_len: int, micro_batch: int, seed: int = 0):
        self.windows = TextWindows(data, seq_len)
        self.seq_len, self.micro_batch, self.seed = seq_len, micro_batch, seed
        self.position = 0

    def batch(self, index: int, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return self.windows.fetch(torch.randint(0, len(self.windows), (size,), generator=g))

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> Tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.position, self.micro_batch)
        self.position += 1
        return out

    def state_dict(self) -> dict:
        """What a checkpoint or snapshot keeps of the stream (pdv's state: engine.data_iterator)."""
        return {"position": int(self.position)}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def text_splits(held_out: float = 0.1) -> Tuple[bytes, bytes]:
    """(train, held-out) byte strings: the last `held_out` fraction of the text is held out."""
    text = doc_text()
    cut = int(len(text) * (1 - held_out))
    return text[:cut], text[cut:]


# ---------------------------------------------------------------------------------------------------
# MLP pipeline (cheap) and digits classification
# ---------------------------------------------------------------------------------------------------
def mlp_layers(n: int = 15, hidden: int = 512, d_in: int = 64, d_out: int = 10) -> list:
    """LayerSpecs: Linear(d_in, hidden), then (n - 2) Linear+ReLU blocks, then Linear(hidden, d_out)."""
    from deepspeed.pipe import LayerSpec

    return ([LayerSpec(nn.Linear, d_in, hidden)] + [LayerSpec(MLPBlock, hidden) for _ in range(n - 2)]
            + [LayerSpec(nn.Linear, hidden, d_out)])


class MLPBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x))


def digits_data(test_fraction: float = 0.25, seed: int = 0):
    """scikit-learn's 8x8 digits, standardised: (x_train, y_train, x_test, y_test) tensors."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    mean, std = x[train].mean(0), x[train].std(0) + 1e-3
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def synthetic_batches(d_in: int, d_out: int, micro_batch: int, seed: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """An endless, seeded stream of (x, class label) micro-batches from a fixed random teacher."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, d_out, generator=g)
    while True:
        x = torch.randn(micro_batch, d_in, generator=g)
        yield x, (x @ teacher).argmax(-1)


class TeacherSamples:
    """Regression on a noisy linear teacher: x ~ N(0, I), y = W x + noise * e, W fixed by `seed`.

    Why: a task whose loss has a known floor. Near it the gradient is mostly label noise, so the noise scale
    grows by orders of magnitude as training converges (the regime where a growing batch pays, issue #36),
    and the held-out loss against the *clean* targets (`clean=True`) is the excess loss itself. Sample i is
    generated from its index alone (no table; any index, any order), so `ElasticBatches` can resume it at
    any position. An indexable dataset of `size` samples with `fetch(indices) -> (x, y)`.
    """

    def __init__(self, d_in: int, d_out: int, noise: float, size: int, seed: int = 0, clean: bool = False):
        g = torch.Generator().manual_seed(int(seed))
        self.weight = torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in)
        self.d_in, self.d_out, self.noise = int(d_in), int(d_out), float(noise)
        self.size, self.seed, self.clean = int(size), int(seed), bool(clean)

    def __len__(self) -> int:
        return self.size

    def fetch(self, idx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        n = len(idx)
        x = torch.empty(n, self.d_in)
        e = torch.zeros(n, self.d_out)
        g = torch.Generator()
        for row, i in enumerate(idx.tolist()):
            g.manual_seed(self.seed * 1_000_003 + 7919 * int(i) + 1)
            x[row] = torch.randn(self.d_in, generator=g)
            if not self.clean:
                e[row] = torch.randn(self.d_out, generator=g)
        # row by row (not a matmul, whose summation order depends on the batch): a sample is the same in any batch
        return x, (x[:, None, :] * self.weight).sum(-1) + self.noise * e


def teacher_layers(d_in: int, d_out: int, hidden: int, layers: int = 3) -> list:
    """LayerSpecs of the teacher task's student: Linear(d_in, hidden), (layers - 2) Linear(hidden, hidden),
    Linear(hidden, d_out) -- a deep *linear* network, so it can fit the teacher exactly and the excess loss
    can go to zero; `layers` >= 2 gives a pipeline stage per layer."""
    from deepspeed.pipe import LayerSpec

    if layers < 2:
        raise ValueError(f"teacher_layers: layers must be >= 2 (got {layers})")
    return ([LayerSpec(nn.Linear, d_in, hidden)] + [LayerSpec(nn.Linear, hidden, hidden) for _ in range(layers - 2)]
            + [LayerSpec(nn.Linear, hidden, d_out)])


def mse_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over samples and outputs."""
    return F.mse_loss(pred, target)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def seed_layer(seed) -> None:
    """`seed_fn` for PipelineModule(seed_layers=True): per-layer seeds make initial weights independent of
    the placement (DeepSpeed's own seeding chokes on the numpy ints its partitioner returns).

    DeepSpeed calls it before every layer of every forward. Without an accelerator only the CPU generator
    is seeded (the same state `torch.manual_seed` gives it): `torch.manual_seed` also queues lazy seeding
    of every absent accelerator type, each call capturing a Python stack trace — milliseconds per layer
    inside a deep pipeline forward, a third of a small model's step.
    """
    seed = int(seed)
    if _ACCELERATED:
        torch.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


_ACCELERATED = (torch.cuda.is_available() or torch.backends.mps.is_available()
                or (hasattr(torch, "xpu") and torch.xpu.is_available()))
