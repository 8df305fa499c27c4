"""The two pieces of judgement the adaptive policies share: smoothing a noisy reading, and acting only when a
condition has held for `patience` agreement steps in a row (so one noisy step does not churn the plan)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union


def ema(old: Optional[Union[float, Sequence[float]]], new: Union[float, Sequence[float]],
        weight: float) -> Union[float, List[float]]:
    """Exponential moving average with `weight` on the past: `new` itself when there is no past (or its
    length changed); element-wise for sequences."""
    if isinstance(new, (int, float)):
        return float(new) if old is None else weight * float(old) + (1.0 - weight) * float(new)
    if old is None or len(old) != len(new):
        return [float(x) for x in new]
    return [weight * o + (1.0 - weight) * n for o, n in zip(old, new)]


def patient(streak: int, patience: int) -> Tuple[int, bool]:
    """One more agreement step on which the condition held: (the new streak, whether to act now). Acting
    starts the count again."""
    streak += 1
    return (0, True) if streak >= patience else (streak, False)
