"""Plan-independent training state: every parameter by its name, its optimizer state as whole tensors.

DeepSpeed names a PipelineModule's parameters by global layer index (`3.fc.weight`; a tied module as
`tied_modules.<key>.<attr>` on every stage that uses it), so a name means the same tensor under any plan.
What a plan cuts up is cut back here into one tensor per parameter:

- torch optimizers on the module's parameters (fp32; `torch_adam: true`): their per-parameter state;
- BF16_Optimizer (bf16) and DeepSpeedZeroOptimizer (ZeRO-1): the fp32 master copies and the optimizer
  state live in one flat partition per parameter group and data-parallel rank; each rank's fragments
  (DeepSpeed's `_hp_mapping`, what its universal checkpoint reads) are gathered over the stage's
  data-parallel group, bit for bit (an integer sum of zero-filled buffers: a float sum would turn -0.0
  into +0.0);
- FP16_Optimizer (fp16 without ZeRO): one whole flat fp32 copy per group, cut at the parameters.

Written back (`apply_params`), each rank copies only the fragments its new partition owns: no
communication. What no plan changes travels once (`global_state`): step counters, the LR schedule,
optimizer hyper-parameters, the loss scaler. The aggregator's per-parameter state (gossip's residuals,
zeno's validation gradient: `Aggregator.per_parameter_state`) is cut at the same names
(`split_aggregator_state` / `join_aggregator_state`).

This module holds the plan-independent value (`ParamState`); cutting a live DeepSpeed engine's state into
it and back is pdv_ext.integrations.deepspeed.layer_state. Used by the cross-plan checkpoint and the move
(pdv_ext.integrations.deepspeed.checkpoint, .move).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn


@dataclass
class ParamState:
    """One parameter (or buffer), whole: what a rank needs to train it under any plan."""

    weight: torch.Tensor
    #: the optimizer's fp32 master copy (bf16, fp16, ZeRO-1); None where the weight is the master
    master: Optional[torch.Tensor] = None
    #: optimizer state: tensors shaped like the parameter (Adam's moments) and scalars (Adam's step)
    optim: Dict[str, Any] = field(default_factory=dict)
    #: index of the optimizer's parameter group; -1 for frozen parameters and buffers
    group: int = -1
    is_buffer: bool = False
    #: this replica's per-parameter aggregator state (flat, this parameter's slice)
    aggregator: Dict[str, Optional[torch.Tensor]] = field(default_factory=dict)

    # ---- as named tensors and scalars (what a transfer sends and a file holds) --------------------
    def without_aggregator(self) -> "ParamState":
        """The same parameter without its replica's aggregator state (what a new replica starts from)."""
        return ParamState(weight=self.weight, master=self.master, optim=self.optim, group=self.group,
                          is_buffer=self.is_buffer)

    def tensors(self) -> Dict[str, torch.Tensor]:
        out = {"weight": self.weight}
        if self.master is not None:
            out["master"] = self.master
        out.update({f"optim/{k}": v for k, v in self.optim.items() if torch.is_tensor(v)})
        out.update({f"{AGGREGATOR_PREFIX}{k}": v for k, v in self.aggregator.items() if v is not None})
        return out

    def scalars(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"group": self.group, "is_buffer": self.is_buffer}
        out.update({f"optim/{k}": v for k, v in self.optim.items() if not torch.is_tensor(v)})
        out.update({f"{AGGREGATOR_PREFIX}{k}": None for k, v in self.aggregator.items() if v is None})
        return out

    @classmethod
    def from_parts(cls, tensors: Dict[str, torch.Tensor], scalars: Dict[str, Any]) -> "ParamState":
        st = cls(weight=tensors["weight"], master=tensors.get("master"), group=int(scalars.get("group", -1)),
                 is_buffer=bool(scalars.get("is_buffer", False)))
        for key, value in list(tensors.items()) + [(k, v) for k, v in scalars.items() if "/" in k]:
            kind, _, name = key.partition("/")
            if kind == "optim":
                st.optim[name] = value
            elif kind == "agg":
                st.aggregator[name] = value
        return st

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


#: the prefix of a replica's own aggregator state among a ParamState's named tensors and scalars
AGGREGATOR_PREFIX = "agg/"


def is_aggregator_key(key: str) -> bool:
    """Whether a named tensor or scalar of a ParamState (`tensors()`, `scalars()`) is the replica's own
    aggregator state, which only the same replica takes along."""
    return key.startswith(AGGREGATOR_PREFIX)


def copy_value(v: Any) -> Any:
    """A tensor detached and cloned; anything else as it is."""
    return v.detach().clone() if torch.is_tensor(v) else v


# ---------------------------------------------------------------------------------------------------
# Plans and names
# ---------------------------------------------------------------------------------------------------
def stages_owning(layers: Sequence[int], boundaries: Sequence[int]) -> List[int]:
    """Stages (under `boundaries`, DeepSpeed's `parts`) that hold any of `layers`."""
    return sorted({s for s in range(len(boundaries) - 1) for l in layers if boundaries[s] <= l < boundaries[s + 1]})


def local_names(module: nn.Module) -> Dict[str, torch.Tensor]:
    """This stage's parameters and buffers by name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


