"""launch/stack.py's launcher: a child started with die_with_parent goes, with everything it started,
when the process that started it dies however it dies, also when that process runs threads (no
preexec_fn); a normal stop still reaches the command itself. The oracle is the kernel's process
table (psutil). Breaks tried: die_with_parent ignored (no guard) -> the child and its own child
outlive the launcher, fails; the guard ignoring SIGTERM with SIG_IGN -> the command inherits it and
only the SIGKILL after the grace ends it (status -9), fails."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from helpers import wait_until

from rollout_service.launch.stack import ManagedProcess

ROOT = Path(__file__).resolve().parents[1]

# A launcher with a thread running, as a Ray actor's worker is: it starts a child that starts a
# child of its own, says the child's pid, and waits to be killed.
LAUNCHER = """
import sys, threading, time
from pathlib import Path
from rollout_service.launch.stack import ManagedProcess
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
sleeper = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
)
proc = ManagedProcess("sleeper", [sys.executable, "-c", sleeper], Path(sys.argv[1]), die_with_parent=True)
proc.start()
print(proc.proc.pid, flush=True)
time.sleep(600)
"""


def _family(pid: int, timeout_s: float = 60.0) -> list[psutil.Process]:
    """`pid` and its descendants, once the sleeper's own child is among them."""
    deadline = time.monotonic() + timeout_s
    while True:
        top = psutil.Process(pid)
        family = [top, *top.children(recursive=True)]
        if any(p.cmdline()[-1:] == ["import time; time.sleep(600)"] for p in family[1:]):
            return family
        assert time.monotonic() < deadline, family
        time.sleep(0.05)


def test_a_launcher_with_threads_killed_hard_takes_its_child_and_grandchild_with_it(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "sleeper.log")], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    family: list[psutil.Process] = []
    try:
        assert launcher.stdout is not None
        guard = int(launcher.stdout.readline())
        family = _family(guard)  # the guard, the command, the command's own child
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(30)
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, alive
    finally:
        launcher.kill()
        launcher.wait(30)
        for proc in family:  # only when the test failed: nothing is left behind
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_stop_reaches_the_command_under_its_guard_and_its_status_comes_back(tmp_path):
    """SIGTERM to the group ends the command as it would end it unguarded (its default action), and
    the guard exits as a shell would say so: 128 + 15, not the SIGKILL after the grace."""
    command = "import time; print('ready', flush=True); time.sleep(600)"
    proc = ManagedProcess("sleeper", [sys.executable, "-c", command], tmp_path / "sleeper.log", die_with_parent=True)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while "ready" not in proc.log_tail():
            assert time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.05)
        proc.stop(grace_s=30)
        assert proc.proc is not None and proc.proc.returncode == 128 + signal.SIGTERM
    finally:
        proc.stop(grace_s=1)


def test_the_pid_it_gives_is_the_commands_own_not_its_guards(tmp_path):
    """Callers signal `pid` and record it as the process holding the server's port (the Ray actors'
    pid files, `ray status`): it must name the command. Break tried: `pid` returning the guard's
    (proc.proc.pid) -> the cmdline is the guard's, and a SIGKILL to it leaves the command running,
    fails."""
    command = "import time; print('ready', flush=True); time.sleep(600)"
    log = tmp_path / "sleeper.log"
    proc = ManagedProcess("sleeper", [sys.executable, "-c", command], log, die_with_parent=True)
    proc.start()
    try:
        assert proc.pid is not None and proc.proc is not None
        # Until the command runs (the guard's fork has exec'd it), its cmdline may read empty.
        assert wait_until(lambda: log.exists() and "ready" in log.read_text(), timeout_s=60)
        server = psutil.Process(proc.pid)
        assert server.cmdline() == [sys.executable, "-c", command] and server.ppid() == proc.proc.pid
        server.send_signal(signal.SIGKILL)
        # The guard exits with the command's status, as a shell would say it.
        assert proc.proc.wait(30) == 128 + signal.SIGKILL
    finally:
        proc.stop(grace_s=1)
