"""pip can build zerort into a wheel through CMake, and the installed package works."""
import os
import pathlib
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_wheel_builds_installs_and_trains(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(pip + ["wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(wheels), ROOT],
                   check=True, capture_output=True, timeout=900)
    (wheel,) = wheels.glob("zerort-*.whl")
    subprocess.run(pip + ["install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    code = ("import torch, zerort; assert zerort.__file__.startswith(%r), zerort.__file__; "
            "m = torch.nn.Linear(4, 2); e = zerort.initialize(m, {'stage': 3, 'comm': {'backend': 'inprocess'}}); "
            "e.backward(e(torch.randn(3, 4)).float().square().mean()); e.step(); "
            "print('OK', e.global_step)") % str(target)
    packages = lambda top: {str(d.relative_to(top)) for d in top.rglob("__init__.py")}
    assert packages(target / "zerort") == packages(pathlib.Path(ROOT, "python", "zerort")), "the wheel's packages"
    env = dict(os.environ, PYTHONPATH=str(target))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK 1" in p.stdout, p.stdout + p.stderr
