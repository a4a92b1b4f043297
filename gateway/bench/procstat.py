"""What a benchmark reads from ``/proc`` (Linux): process CPU time, memory, and how busy the machine is.

CPU times come from ``/proc/<pid>/stat`` (utime + stime of the whole thread group, in clock ticks,
so a 10 ms resolution on most kernels); memory from ``/proc/<pid>/status``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

_TICK = float(os.sysconf("SC_CLK_TCK"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of all threads of ``pid`` so far (0 if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may contain spaces
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of stat(5))


def total_cpu_seconds(pids: Iterable[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (e.g. nginx's workers)."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(raw[raw.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry))
    return found


def memory_bytes(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS), RssAnon, RssFile... of ``pid`` in bytes (empty if it is gone)."""
    out: dict[str, int] = {}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return out
    for line in lines:
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and (name.startswith("Vm") or name.startswith("Rss")):
            out[name] = int(parts[0]) * 1024
    return out


def reset_peak_rss(pid: int) -> bool:
    """Reset ``pid``'s VmHWM to its current RSS (``clear_refs`` 5, Linux >= 4.0); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def machine_busy_seconds() -> tuple[float, float]:
    """(user + nice + system CPU seconds summed over all cores, steal seconds) since boot, from
    ``/proc/stat``. Interrupt and softirq time is left out: loopback traffic of the process being
    measured is accounted there, not to any process."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system) / _TICK, steal / _TICK


def task_cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds of every thread of ``pids`` so far, from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds,
    where ``cpu_seconds`` counts clock ticks): for short phases. Threads that ended are not counted."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except (FileNotFoundError, ProcessLookupError):
            continue
        for tid in tids:
            try:
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    return total / 1e9
