"""Build veloce's one extension, ``veloce._C``, against the torch already installed.

CPU kernels are always built. CUDA kernels are added when torch is a CUDA build and
``nvcc`` is found, unless ``VELOCE_USE_CUDA=0``. Build without isolation so the
extension links against *your* torch::

    pip install --no-build-isolation .

Environment:
    VELOCE_USE_CUDA=0|1   force CPU-only (0) or require CUDA (1); default: auto.
    VELOCE_DEBUG=1        build with -O0 -g.
    MAX_JOBS=N            parallel compile jobs (ninja).
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - message for users who forgot the flag
    sys.exit(
        "veloce builds against the torch that is already installed. Install torch first "
        "(e.g. `pip install torch`), then build with `pip install --no-build-isolation .`."
    )

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    flag = os.environ.get("VELOCE_USE_CUDA", "auto").lower()
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        if not available:
            sys.exit(
                "VELOCE_USE_CUDA=1 but torch is not a CUDA build or nvcc was not found "
                f"(torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME})."
            )
        return True
    return available


def extensions():
    use_cuda = _want_cuda()
    debug = os.environ.get("VELOCE_DEBUG", "0") == "1"
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    # -fno-math-errno: sqrt never sets errno, so loops with sqrt vectorize (we never read errno).
    # No -std flag: BuildExtension adds the standard this torch was built with (C++17 for
    # older torch, C++20 for newer); compiling its headers under another one breaks the ABI
    # (seen: a crash formatting an error message with torch 2.11 under -std=c++17).
    # No -fvisibility=hidden: with the CUDA objects it made the library bind its own copy
    # of libstdc++'s ostream code (instantiated in an nvcc-compiled file) whose locale
    # facets were never registered, and formatting any error message crashed.
    # -ffp-contract=off: no a * b + c fused into one FMA (GCC does so by default where the
    # target has FMA, e.g. aarch64): the CPU kernels are the specification, and their sums
    # must be the same, bit for bit, on every machine (tests/sparse/test_embedding.py checks them
    # against a sequential sum with a rounding after each multiply and each add).
    cxx += ["-fno-math-errno", "-ffp-contract=off"]
    # py_limited_api=True (below) makes BuildExtension define Py_LIMITED_API itself.
    define_macros = []
    link = []
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        # at::parallel_for is a header template: with torch's OpenMP backend it only runs
        # in parallel if this extension is compiled with OpenMP too (else it is serial).
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    extra = {"cxx": cxx}
    ext_cls = CppExtension
    if use_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        define_macros.append(("VELOCE_WITH_CUDA", "1"))
        extra["nvcc"] = (["-O0", "-g", "-G"] if debug else ["-O3", "-lineinfo"]) + [
            "--expt-relaxed-constexpr",
            "--extended-lambda",
        ]
        ext_cls = CUDAExtension
    return [
        ext_cls(
            "veloce._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc", "include")],
            define_macros=define_macros,
            extra_compile_args=extra,
            extra_link_args=link,
            py_limited_api=True,
        )
    ]


setup(
    packages=find_packages(include=["veloce", "veloce.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
