"""Builds nanograph: the Python package plus the C++/CUDA core (nanograph._C) through CMake.

The core needs nvcc. Without it the package still installs, without the core, and
`import nanograph` reports that (the torch backend runs the engine then).
Environment: NANOGRAPH_CUDA_ARCHS (e.g. "90a" or "80;90a") overrides the target architectures;
CUDACXX names the CUDA compiler.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "80;86;90a"


def log(message):
    print(f"nanograph: {message}", file=sys.stderr, flush=True)


def find_nvcc():
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def cuda_archs():
    if os.environ.get("NANOGRAPH_CUDA_ARCHS"):
        return os.environ["NANOGRAPH_CUDA_ARCHS"]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        caps = sorted({line.strip().replace(".", "") for line in out.splitlines() if line.strip()})
        if caps:
            # Hopper-only instructions (wgmma) need the arch-specific 90a target.
            return ";".join("90a" if c == "90" else c for c in caps)
    except (OSError, subprocess.SubprocessError):
        pass
    return DEFAULT_ARCHS


def wheel_cublas_root():
    """The nvidia-cublas wheel's folder (include/ + lib/), if that wheel is importable."""
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}:
        for sub in ("nvidia/cu13", "nvidia/cublas"):
            root = os.path.join(base, sub)
            if glob.glob(os.path.join(root, "include", "cublasLt.h")):
                return root
    return None


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self):
        nvcc = find_nvcc()
        if nvcc is None:
            log("WARNING: no CUDA compiler (nvcc) found; installing WITHOUT the C++/CUDA core. "
                "The engine will run on the torch backend only. Install the CUDA toolkit or set "
                "CUDACXX, then reinstall, to build the core.")
            return
        for ext in self.extensions:
            self.build_cmake(ext, nvcc)

    def build_cmake(self, ext, nvcc):
        out_dir = os.path.abspath(os.path.dirname(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        import pybind11

        archs = cuda_archs()
        args = [
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        cublas_root = wheel_cublas_root()
        if cublas_root:
            args.append(f"-DNANOGRAPH_CUBLAS_ROOT={cublas_root}")
        if shutil.which("ninja"):
            args.append("-GNinja")
        log(f"building the core with {nvcc} for CUDA architectures {archs}")
        subprocess.run(["cmake", ROOT, *args], cwd=build_dir, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", ".", "--target", "_C", "-j", jobs], cwd=build_dir,
                       check=True)


setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("nanograph._C")],
    cmdclass={"build_ext": CMakeBuild},
)
