"""What a communication backend's errors say: a short form for messages, and whether one
reports a peer gone (see [Note: failure propagation] in monitor.py)."""
from __future__ import annotations

import re

import torch.distributed as dist

__all__ = ["brief", "lost_peer"]


def brief(exc: BaseException) -> str:
    """``exc``'s first line, without the source location and advice gloo wraps it in."""
    text = (str(exc).splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", text)
    return text.split(". This is typically caused", 1)[0][:300]


_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|gloo/transport/")


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is the communication backend's report of a peer gone (its connection
    closed), as gloo raises it when a transfer or collective is posted to a dead process."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and bool(_LOST_PEER.search(str(exc))))
