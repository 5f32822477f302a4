"""Builds torch_pjrt._C with the project's CMake + Ninja build (see pyproject.toml).

The CMake build directory is ./build (TORCH_PJRT_BUILD_DIR overrides it), the
same one `make build` uses, so an install after `make build` rebuilds nothing.
"""
import os
import shutil
import subprocess
import sys

import setuptools
from setuptools import Extension, setup

# --no-build-isolation builds with this environment's setuptools, and pip skips
# pyproject's `requires` then: a new venv's setuptools (65.x) has no bdist_wheel
# and fails with "invalid command 'bdist_wheel'". Say what to do instead.
if tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit()) < (70, 1):
    sys.exit(f"torch_pjrt: building needs setuptools>=70.1 (this environment has {setuptools.__version__}, "
             "without bdist_wheel). Run: pip install 'setuptools>=70.1' cmake ninja xla-cpu-pjrt, "
             "then pip install --no-build-isolation . again")
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.path.abspath(os.environ.get("TORCH_PJRT_BUILD_DIR", os.path.join(ROOT, "build")))
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            # A fresh build directory. A configured one (`make build`) is reused as
            # it is: ninja re-runs CMake itself when CMakeLists.txt changed.
            # The C++ tests only where GTest is installed (`make build` installs it).
            gtest = os.path.exists("/usr/include/gtest/gtest.h")
            subprocess.check_call(["cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                                   f"-DPython3_EXECUTABLE={sys.executable}",
                                   f"-DTORCH_PJRT_BUILD_TESTS={'ON' if gtest else 'OFF'}"])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.check_call(["ninja", "-C", build_dir, f"-j{jobs}", "_C"])
        built = os.path.join(ROOT, "python", "torch_pjrt", "_C.so")  # where CMake puts it
        target = os.path.abspath(self.get_ext_fullpath(ext.name))
        if target != built:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(built, target)

    def get_ext_filename(self, name):
        # `_C.so`, the name CMake gives it: a second `_C.cpython-*.so` in the
        # source tree (editable installs) would shadow later `ninja` rebuilds.
        return os.path.join(*name.split(".")) + ".so"


# setuptools' own metadata goes to build/, not python/: a torch_pjrt.egg-info on
# PYTHONPATH=python would declare the torch.backends entry point to every
# `import torch` run from the source tree.
EGG_BASE = os.path.join("build", "egg-info")
os.makedirs(os.path.join(ROOT, EGG_BASE), exist_ok=True)
setup(ext_modules=[Extension("torch_pjrt._C", sources=[])], cmdclass={"build_ext": CMakeBuild},
      options={"egg_info": {"egg_base": EGG_BASE}})
