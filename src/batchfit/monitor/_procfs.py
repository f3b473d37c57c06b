"""Reading a process tree from ``/proc``: who descends from whom, resident memory, command lines."""

from __future__ import annotations

import os

from batchfit._units import BYTES_IN_KIB


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process in /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive."""
    tree = _children()
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(tree.get(pid, ()))
    return found


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of ``pid`` (0 once it is gone); ``field="VmHWM"``: its high-water mark."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * BYTES_IN_KIB
    except OSError:
        pass
    return 0


def pss_bytes(pid: int) -> int | None:
    """Proportional resident memory of ``pid`` (a page shared by N processes counts 1/N);
    None where the kernel does not say (no smaps_rollup: Linux before 4.14, or gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * BYTES_IN_KIB
    except OSError:
        pass
    return None


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
