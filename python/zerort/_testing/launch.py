"""Starting a test's ranks as real processes: under torchrun, under mpirun, alone (one
process, no launcher), or as plain processes with torchrun's variables and nobody to end a
rank for them (launch_plain).

Every launch runs with the environment the tests need (Open MPI allowed to run as root,
mpirun --oversubscribe, OMP_NUM_THREADS=1, then the caller's env on top) and within a
timeout: a launch still running then hung, and its whole process group is killed. A launch
that hung, or (with check=True) exited with a status other than 0, raises LaunchError, whose
message ends with the tail of the ranks' output. Nothing is retried.
"""
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
LAUNCHERS = ("torchrun", "mpirun", "alone")
TAIL = 6000  # characters of output an error shows


class LaunchError(AssertionError):
    """A launch that hung or failed; the message ends with the tail of the ranks' output."""


@dataclasses.dataclass
class Launched:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self):
        return self.stdout + self.stderr


def command(launcher, nranks, script, *args):
    """The command line that runs `python script args...` as nranks ranks under launcher."""
    argv = [str(script), *map(str, args)]
    if launcher == "torchrun":
        return [TORCHRUN, "--standalone", "--nproc_per_node", str(nranks), *argv]
    if launcher == "mpirun":
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise LaunchError("mpirun is not on PATH (install Open MPI: make test installs openmpi-bin)")
        return [mpirun, "--oversubscribe", "-np", str(nranks), sys.executable, *argv]
    if launcher == "alone":
        if nranks != 1:
            raise ValueError(f"launcher 'alone' runs one process, not {nranks}")
        return [sys.executable, *argv]
    raise ValueError(f"launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")


def environment(env=None):
    return {**os.environ, **ENV, **(env or {})}


def launch(launcher, nranks, script, *args, timeout=300, env=None, check=True):
    """Runs script as nranks ranks under launcher ("torchrun", "mpirun" or "alone"); returns
    a Launched (exit status, stdout, stderr, seconds)."""
    what = f"{launcher} with {nranks} rank{'s' * (nranks != 1)}: {os.path.basename(str(script))} " \
           f"{' '.join(map(str, args))}"
    return run(command(launcher, nranks, script, *args), timeout=timeout, env=env, check=check, what=what)


def run(cmd, *, timeout, env=None, check=True, what=None):
    """Runs one command line (a launcher and its ranks) in a process group of its own."""
    what = what or " ".join(map(str, cmd))
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=environment(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = _drain(p)
        raise LaunchError(f"{what}: hung (no exit in {timeout} s); killed\n{_tail(out + err)}") from None
    done = Launched(p.returncode, out, err, time.monotonic() - t0)
    if check and done.returncode != 0:
        raise LaunchError(f"{what}: exited with status {done.returncode}\n{_tail(done.output)}")
    return done


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_plain(nranks, script, *args, timeout=300, env=None):
    """nranks plain processes of `python script args...` with torchrun's variables (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): no launcher ends a rank when another
    fails. Returns one Launched per rank (its output in stdout, stderr merged into it; its
    seconds from the start of all of them), whatever their exit status."""
    port, t0 = free_port(), time.monotonic()
    logs = [tempfile.TemporaryFile("w+") for _ in range(nranks)]
    procs = [subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=log, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True,
                              env=environment({**(env or {}), "RANK": str(r), "LOCAL_RANK": str(r),
                                               "WORLD_SIZE": str(nranks), "MASTER_ADDR": "127.0.0.1",
                                               "MASTER_PORT": str(port)}))
             for r, log in enumerate(logs)]
    done = []
    try:
        for p in procs:
            left = t0 + timeout - time.monotonic()
            try:
                p.wait(timeout=max(left, 0.01))
            except subprocess.TimeoutExpired:
                texts = [_read(log) for log in logs]
                raise LaunchError(f"{nranks} plain processes of {os.path.basename(str(script))}: hung (no exit in "
                                  f"{timeout} s); killed\n"
                                  + "\n".join(f"--- rank {r}:\n{_tail(t, TAIL // nranks)}"
                                              for r, t in enumerate(texts))) from None
            done.append(time.monotonic() - t0)
        return [Launched(p.returncode, _read(log), "", took) for p, log, took in zip(procs, logs, done)]
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
                p.wait()
        for log in logs:
            log.close()


def _kill_group(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _drain(p):
    try:
        return p.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a rank left the group and holds the pipes
        p.kill()
        return "", "(output lost: a process outside the launch's group kept its pipes open)"


def _read(log):
    log.flush()
    log.seek(0)
    return log.read()


def _tail(text, n=TAIL):
    return text if len(text) <= n else "..." + text[-n:]
