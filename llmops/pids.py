"""Whether a process of this host still runs: how row claims and sink temporaries tell a crashed owner's
leftovers from a live owner's."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True when process `pid` of this host runs (or exists but belongs to another user); False when no such
    process exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
