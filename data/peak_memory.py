"""Peak resident memory of this process, for the data CLI's report and the memory tests."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started (exec), in bytes.

    Linux's VmHWM, not `ru_maxrss`: across exec, ru_maxrss keeps the parent's
    peak at the fork, so a child of a large process would report the parent's.
    """
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:  # not Linux: ru_maxrss (kilobytes there too on most systems) is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (kilobytes,) = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")]
    return int(kilobytes) * 1024
