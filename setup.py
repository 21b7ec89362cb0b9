"""Builds zerort._C through the project's CMake (pip install --no-build-isolation .)."""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir), f"-DPython3_EXECUTABLE={sys.executable}",
                     "-DCMAKE_BUILD_TYPE=Release", "-DZERORT_BUILD_TESTS=OFF", "-DZERORT_BUILD_EXAMPLES=OFF",
                     f"-DZERORT_PYTHON_OUTPUT_DIR={out_dir}"]
        subprocess.run(configure, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs], check=True)


setup(ext_modules=[Extension("zerort._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
