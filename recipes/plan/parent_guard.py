"""Start a compile process that dies with its parent: `python -m spillway.recipes.plan.parent_guard MODULE ARGS`.

A compile process left running after its planner died keeps a core busy for
a minute or more (reparented to init) for an answer no one reads. On Linux
this arms the kernel's parent-death signal (prctl PR_SET_PDEATHSIG, SIGKILL)
before anything else is imported, then checks that the parent it was started
by (SPILLWAY_PARENT_PID) is still its parent, since the parent may have died
before the signal was armed; then it runs MODULE as `python -m MODULE ARGS`
would. Elsewhere only the parent's own clean-up (subprocess_runner) applies.
Nothing here imports JAX.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

PARENT_PID_ENV = "SPILLWAY_PARENT_PID"
_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def die_with_parent() -> bool:
    """Arms SIGKILL on parent death (Linux); exits at once if the parent is already gone. True if armed."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and expected.isdigit() and os.getppid() != int(expected):
        os._exit(1)   # the parent died before the signal was armed: no one waits for this process
    return armed


if __name__ == "__main__":
    die_with_parent()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
