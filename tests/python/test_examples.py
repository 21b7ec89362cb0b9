"""The examples run briefly: train_gpt.py without a launcher (world size 1), train_deepspeed.py
under torchrun."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_gpt_launcher_free_smoke():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--launcher-free",
                        "--steps", "3", "--layers", "2", "--d-model", "64", "--seq", "32", "--precision", "fp16"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "W=1 [inprocess]" in p.stdout and "step   3  loss" in p.stdout, p.stdout


def test_train_deepspeed_under_torchrun(tmp_path):
    """The DeepSpeed script with its config, as the README runs it, for 10 updates."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2",
                        os.path.join(ROOT, "examples", "train_deepspeed.py"), "--deepspeed_config",
                        os.path.join(ROOT, "examples", "ds_config.json"), "--steps", "10", "--save-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "[Rank 0] step=10, skipped=0, lr=[0.0014666666666666667, 0.0014666666666666667]" in p.stdout, p.stdout
    assert f"saved and loaded {tmp_path}/step10: client_state {{'updates': 10}}, 160 samples" in p.stdout, p.stdout
