"""The process's resident high-water mark, read where the kernel keeps it and measured where it does not.

Linux keeps it as VmHWM in /proc/self/status (reset to the current resident size by writing 5 to
/proc/self/clear_refs). gVisor, the sandbox of the TPU machine lent here, has no VmHWM: there a thread
samples VmRSS every millisecond and keeps the largest (it can miss a peak shorter than that; the
benchmarks' phases last seconds), and where /proc has neither, getrusage's maxrss stands in (not
resettable: a phase's rise then reads 0 unless it passes the process's earlier peak).
"""

from __future__ import annotations

import resource
import threading
import time


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None


class ResidentPeak:
    """`peak()`: the largest resident size since the last `reset()` (or since the process started)."""

    def __init__(self, sample_s: float = 0.001):
        self.source = "VmHWM" if _status_bytes("VmHWM") is not None else (
            "sampled VmRSS" if _status_bytes("VmRSS") is not None else "ru_maxrss")
        self._largest = 0
        if self.source == "sampled VmRSS":
            self._largest = _status_bytes("VmRSS") or 0
            self._sample_s = sample_s
            threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self._largest = max(self._largest, _status_bytes("VmRSS") or 0)
            time.sleep(self._sample_s)

    def reset(self) -> bool:
        """Starts a new high-water mark at the current resident size; False where it cannot (ru_maxrss)."""
        if self.source == "VmHWM":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")   # VmHWM := VmRSS now
                return True
            except OSError:
                return False
        if self.source == "sampled VmRSS":
            self._largest = _status_bytes("VmRSS") or 0
            return True
        return False

    def peak(self) -> int:
        if self.source == "VmHWM":
            return _status_bytes("VmHWM") or 0
        if self.source == "sampled VmRSS":
            self._largest = max(self._largest, _status_bytes("VmRSS") or 0)
            return self._largest
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux
