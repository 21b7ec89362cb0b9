"""python -m zerort.integrations.deepspeed.launcher runs an unchanged DeepSpeed script
(ds_launcher_script.py: `import deepspeed` and four deepspeed.* modules) at W = 2 and 4, its
ranks started by torchrun and by mpirun: deepspeed.comm against the values each collective
must give, the --local_rank argument, and the losses against plain PyTorch. Also the
launcher's host and rank plan, and the import alias's errors."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from zerort._testing.launch import free_port, run
from zerort.errors import ConfigError
from zerort.integrations.deepspeed import launcher

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ds_launcher_script.py")
LAUNCHER = [sys.executable, "-m", "zerort.integrations.deepspeed.launcher"]


def launch(tmp_path, world, stage, *flags):
    out = str(tmp_path / "out")
    done = run(LAUNCHER + ["--num_gpus", str(world), "--master_port", str(free_port()), *flags,
                           SCRIPT, "--out", out, "--stage", str(stage)],
               timeout=300, env={"PYTHONPATH": os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")})
    return done, [json.load(open(f"{out}.rank{r}.json")) for r in range(world)]


@pytest.mark.parametrize("world,stage,flags", [(2, 2, ()), (4, 1, ()),
                                               (2, 3, ("--launcher", "openmpi", "--launcher_args=--oversubscribe"))],
                         ids=["torchrun-W2-stage2", "torchrun-W4-stage1", "openmpi-W2-stage3"])
def test_an_unchanged_deepspeed_script_runs(tmp_path, world, stage, flags):
    done, ranks = launch(tmp_path, world, stage, *flags)
    assert done.stdout.count("on zerort's DeepSpeed drop-in (not DeepSpeed)") == 1
    total = sum(range(1, world + 1))
    for r, seen in enumerate(ranks):
        assert seen["torch_rank"] == r and seen["world"] == world and seen["is_initialized"]
        assert seen["local_rank_arg"] == r == seen["local_rank"]  # DeepSpeed's launcher argument
        assert seen["all_reduce"] == [float(total)] * 3
        assert seen["broadcast"] == [float(world - 1 + 10)] * 2
        assert seen["all_gather_into_tensor"] == [float(k) for k in range(world) for _ in range(2)]
        # input arange(2W) * (rank + 1) summed over ranks: chunk r is [2r, 2r + 1] * total
        assert seen["reduce_scatter_tensor"] == [2.0 * r * total, (2.0 * r + 1) * total]
        assert seen["device"] == "cpu" and seen["wte_full_shape"] == [64, 32]
        assert seen["lrs"] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2, 1e-2, 1e-2])  # the LambdaLR, followed
        assert seen["losses"] == ranks[0]["losses"]
    assert ranks[0]["zero_to_fp32_matches"]
    assert ranks[0]["losses"] == pytest.approx(ranks[0]["reference"], abs=2e-5)  # FP32 run vs plain torch


def test_a_module_zerort_lacks_is_named(tmp_path):
    script = tmp_path / "uses_pipe.py"
    script.write_text("import deepspeed\nimport deepspeed.pipe\n")
    done = run(LAUNCHER + ["--num_gpus", "1", str(script)], timeout=120, check=False)
    assert done.returncode != 0
    assert "No module named 'deepspeed.pipe': zerort's DeepSpeed drop-in runs this script" in done.stderr


def test_the_alias_leaves_other_processes_alone():
    """Outside the launcher's ranks, `import deepspeed` is whatever the environment has."""
    code = "import importlib.util, zerort.integrations.deepspeed; print(importlib.util.find_spec('deepspeed'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "zerort" not in out


def test_inside_the_alias_deepspeed_is_the_drop_in_with_its_metadata():
    code = ("from zerort.integrations.deepspeed import alias; alias.install()\n"
            "import importlib.metadata, deepspeed, deepspeed.comm as dist, zerort.integrations.deepspeed as ours\n"
            "from deepspeed.ops.adam import FusedAdam\n"
            "assert deepspeed is ours and dist is ours.comm and FusedAdam is ours.ops.adam.FusedAdam\n"
            "print(importlib.metadata.version('deepspeed'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0.19.8"


def args(*argv):
    return launcher.parser().parse_args([*argv, "train.py"])


def test_the_rank_plan_follows_deepspeeds_flags(tmp_path):
    assert launcher.plan(args("--num_gpus", "3"), 0) == {"localhost": [0, 1, 2]}
    assert launcher.plan(args(), 2) == {"localhost": [0, 1]}  # every GPU, as DeepSpeed
    assert launcher.plan(args(), 0) == {"localhost": [0]}
    assert launcher.plan(args("--include", "localhost:1,3"), 4) == {"localhost": [1, 3]}
    assert launcher.plan(args("--exclude", "localhost:0"), 3) == {"localhost": [1, 2]}
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode1 slots=2\nnode2 slots=2\n")
    assert launcher.plan(args("--hostfile", str(hostfile)), 0) == {"node1": [0, 1], "node2": [0, 1]}
    assert launcher.plan(args("--hostfile", str(hostfile), "--num_nodes", "1"), 0) == {"node1": [0, 1]}
    assert launcher.plan(args("--hostfile", str(hostfile), "--include", "node2"), 0) == {"node2": [0, 1]}


def test_launcher_errors_name_the_flag(tmp_path):
    bad = tmp_path / "hosts"
    bad.write_text("node1 slots=two\n")
    with pytest.raises(ConfigError, match=r"line 1: 'node1 slots=two'; each line is 'hostname slots=N'"):
        launcher.plan(args("--hostfile", str(bad)), 0)
    with pytest.raises(ConfigError, match="no such file"):
        launcher.plan(args("--hostfile", str(tmp_path / "missing")), 0)
    with pytest.raises(ConfigError, match="give one of them"):
        launcher.plan(args("--include", "localhost:0", "--exclude", "localhost:1"), 2)
    good = tmp_path / "two"
    good.write_text("node1 slots=2\nnode2 slots=2\n")
    a = args("--hostfile", str(good))
    with pytest.raises(ConfigError, match="does not reach other hosts over ssh"):
        launcher.command(a, launcher.plan(a, 0))
    a = args("--launcher", "pdsh")
    with pytest.raises(ConfigError, match="--launcher pdsh"):
        launcher.command(a, launcher.plan(a, 0))
    a = args("--hostfile", str(good), "--num_nodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1")
    argv, _ = launcher.command(a, launcher.plan(a, 0))
    assert "--nnodes=2" in argv and "--node_rank=1" in argv and "--master_addr=10.0.0.1" in argv
    a = args("--launcher", "openmpi", "--hostfile", str(good), "--no_local_rank")
    argv, env = launcher.command(a, launcher.plan(a, 0))
    assert argv[:5] == ["mpirun", "-np", "4", "-H", "node1:2,node2:2"] and env["ZERORT_DS_NO_LOCAL_RANK"] == "1"
    assert argv[argv.index("ZERORT_DS_NO_LOCAL_RANK") - 1] == "-x"  # forwarded to the other host's ranks
    assert isinstance(launcher.parser(), argparse.ArgumentParser)
