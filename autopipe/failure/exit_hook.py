"""How a process leaves after a failure: see [Note: exit after a failure]."""
from __future__ import annotations

import atexit
import os
import sys
from types import TracebackType

__all__ = ["install"]

# [Note: exit after a failure]
# After a failure a daemon thread may still be blocked in gloo's ``wait()`` on a receive that a
# failed peer never sends. When that peer's process exits, the wait fails and the thread takes
# the GIL back; if the interpreter is finalizing by then, CPython ends the thread with
# pthread_exit, whose unwinding through torch's C++ frames calls std::terminate: the process
# aborts ("terminate called without an active exception", exit code -6) although it failed
# with a typed error. NCCL's teardown can likewise block on kernels a dead peer never joined.
# Neither the works nor gloo's process groups can be aborted to release such a thread. So the
# first failure a process sees installs a ``sys.excepthook`` that prints the error as usual,
# runs the atexit handlers, flushes the standard streams and leaves with ``os._exit(1)``: the
# exit code of any uncaught Python error, without the finalization that would abort. It acts
# on uncaught errors of scripts only (not in an interactive interpreter); a script that
# catches the PipelineFailure and returns normally gets the usual finalization.

_installed = False


def install() -> None:
    """Makes an uncaught error end this process as described in the Note (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if hasattr(sys, "ps1") or sys.flags.interactive:
            previous(kind, value, tb)
            return
        try:
            previous(kind, value, tb)
        finally:
            _leave(1)

    sys.excepthook = hook


def _leave(code: int) -> None:
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
                pass
        os._exit(code)
