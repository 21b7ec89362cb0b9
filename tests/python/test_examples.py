"""The examples run: train_gpt.py without a launcher (world size 1), briefly."""
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
