"""zerort._testing.launch, the one way the tests start ranks: a failed or hung launch raises
LaunchError showing the ranks' output (never retried), plain processes get torchrun's
variables; and the kernel wrappers are not in the public namespace."""
import time

import pytest

import zerort
from zerort._testing.launch import LaunchError, command, launch, launch_plain

SCRIPT = """import os, sys, time
print("rank", os.environ.get("RANK"), "of", os.environ.get("WORLD_SIZE"), "omp", os.environ["OMP_NUM_THREADS"])
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(SCRIPT)
    return path


def test_a_clean_launch_returns_its_output(script):
    p = launch("alone", 1, script, 0, timeout=60)
    assert p.returncode == 0 and "omp 1" in p.stdout and "to stderr" in p.stderr and p.seconds < 60


def test_a_failed_launch_raises_with_the_output(script):
    with pytest.raises(LaunchError, match=r"(?s)exited with status 3.*omp 1.*to stderr"):
        launch("alone", 1, script, 3, timeout=60)
    assert launch("alone", 1, script, 3, timeout=60, check=False).returncode == 3


def test_a_hung_launch_is_killed_and_raises(script):
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)hung \(no exit in 2 s\).*omp 1"):
        launch("alone", 1, script, "sleep", timeout=2)
    assert time.monotonic() - t0 < 30
    with pytest.raises(LaunchError, match=r"(?s)hung.*rank 0.*rank 1"):
        launch_plain(2, script, "sleep", timeout=2)


def test_plain_processes_get_torchruns_variables(script):
    ranks = launch_plain(2, script, 5, timeout=60)
    assert [r.returncode for r in ranks] == [5, 5]
    assert [r.stdout.splitlines()[0] for r in ranks] == ["rank 0 of 2 omp 1", "rank 1 of 2 omp 1"]


def test_commands():
    assert command("torchrun", 2, "w.py", 1)[-5:] == ["--standalone", "--nproc_per_node", "2", "w.py", "1"]
    if zerort._C.with_mpi:
        assert command("mpirun", 4, "w.py")[1:4] == ["--oversubscribe", "-np", "4"]
    with pytest.raises(ValueError, match="one process"):
        command("alone", 2, "w.py")
    with pytest.raises(ValueError, match="expected one of"):
        command("srun", 2, "w.py")


def test_kernel_wrappers_are_not_public():
    assert not hasattr(zerort, "cast") and not hasattr(zerort, "kernels")
