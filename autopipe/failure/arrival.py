"""Who did not come to a collective call: the message a rank raises when ``arrive()`` times out
(see :meth:`autopipe.failure.monitor.FailureMonitor.arrive`)."""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["absent"]


def absent(store: dist.Store, size: int, base: str, what: str, deadline: float) -> str:
    """Which of the ``size`` ranks did not call ``what`` under the store keys ``base`` (and what
    they called instead), within ``deadline`` seconds."""
    missing, other = [], []
    for r in range(size):
        try:
            called = store.get(f"{base}/rank{r}").decode() if store.check([f"{base}/rank{r}"]) else None
        except Exception:  # noqa: BLE001 - the message is best effort
            called = None
        if called != what:
            missing.append(r)
            if called is not None:
                other.append(f"rank {r} called {called}")
    ranks = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
    instead = f" ({'; '.join(other[:4])} instead)" if other else ""
    return (f"{what} is collective, and rank{'s' if len(missing) > 1 else ''} {ranks} did not call it "
            f"within {deadline:g} s{instead}; "
            f"call it on every rank (or raise deadline= if a rank is this slow to get there)")
