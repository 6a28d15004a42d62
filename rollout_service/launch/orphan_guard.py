"""Runs a command and ends it, with everything it started, when the process that launched it dies.

    python -m rollout_service.launch.orphan_guard FD PID_FD COMMAND...

FD is the read end of a pipe whose write end only the launcher holds (ManagedProcess): the kernel
closes it when the launcher exits, however it exits (a Ray actor's worker killed hard included), and
the read here then ends with EOF. Nothing runs in the launcher between fork and exec, so this is
safe in a launcher with threads, unlike a `preexec_fn` setting PR_SET_PDEATHSIG.

PID_FD is the write end of a pipe the launcher reads: the guard writes the command's pid there and
closes it. Whoever asks the launcher for the server's pid means the command (to signal it, to
record which process holds its port), not the guard.

The guard leads the command's process group (ManagedProcess starts it in a session of its own):
signals sent to the group reach the command directly, and the guard waits for it and exits with its
status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading


def _watch(fd: int) -> None:
    """Block until the launcher is gone, then kill the whole group (this guard included)."""
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main() -> None:
    fd, pid_fd, command = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    # The group's signals reach the command itself; the guard only waits for it. A handler (not
    # SIG_IGN, which the command would inherit) keeps the guard alive meanwhile.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    child = subprocess.Popen(command)
    with os.fdopen(pid_fd, "w") as said:
        said.write(str(child.pid))
    threading.Thread(target=_watch, args=(fd,), daemon=True).start()
    code = child.wait()
    sys.exit(code if code >= 0 else 128 - code)  # killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    main()
