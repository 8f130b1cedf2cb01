"""Build veloce's extensions against the torch already installed: ``veloce._C`` (the ops)
and, where RocksDB is found, ``veloce._rocksdb`` (the RocksDB tier's store).

CPU kernels are always built. CUDA kernels are added when torch is a CUDA build and
``nvcc`` is found, unless ``VELOCE_USE_CUDA=0``. ``veloce._rocksdb`` is a separate
library linked with ``-lrocksdb`` so that ``veloce._C`` loads on machines without
RocksDB (``apt-get install librocksdb-dev`` provides it). Build without isolation so the
extensions link against *your* torch::

    pip install --no-build-isolation .

Environment:
    VELOCE_USE_CUDA=0|1   force CPU-only (0) or require CUDA (1); default: auto.
    VELOCE_ROCKSDB=0|1    skip veloce._rocksdb (0) or require it (1); default: auto (built
                          when RocksDB's header and library are found).
    ROCKSDB_ROOT=PREFIX   where RocksDB is installed (PREFIX/include, PREFIX/lib); default:
                          the system's include and library directories.
    VELOCE_DEBUG=1        build with -O0 -g.
    MAX_JOBS=N            parallel compile jobs (ninja).
"""

from __future__ import annotations

import glob
import os
import sys
import sysconfig

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


def _flag(name: str) -> str:
    value = os.environ.get(name, "auto").lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value in ("1", "true", "yes", "on"):
        return "on"
    if value != "auto":
        sys.exit(f"{name} must be 0, 1 or auto, got {os.environ[name]!r}.")
    return "auto"


def _find_rocksdb() -> tuple[str, str] | str:
    """RocksDB's (include dir, library dir), or why it cannot be used."""
    root = os.environ.get("ROCKSDB_ROOT")
    if root:
        includes = [os.path.join(root, "include")]
        libs = [os.path.join(root, "lib"), os.path.join(root, "lib64")]
    else:
        multiarch = sysconfig.get_config_var("MULTIARCH") or ""
        includes = ["/usr/include", "/usr/local/include", "/opt/homebrew/include"]
        libs = ["/usr/lib", "/usr/lib64", "/usr/local/lib", "/opt/homebrew/lib"]
        if multiarch:
            libs.insert(0, os.path.join("/usr/lib", multiarch))
    include = next((d for d in includes if os.path.isfile(os.path.join(d, "rocksdb", "db.h"))), None)
    names = ("librocksdb.so*", "librocksdb.dylib")
    lib = next((d for d in libs if any(glob.glob(os.path.join(d, name)) for name in names)), None)
    where = f"ROCKSDB_ROOT={root}" if root else "the system's directories"
    if include is None:
        return f"rocksdb/db.h not found in {where} ({', '.join(includes)})"
    if lib is None:
        return f"librocksdb not found in {where} ({', '.join(libs)})"
    # A distribution's librocksdb is built with the C++11 string ABI: a torch built with the
    # old one cannot pass it a std::string.
    if not torch.compiled_with_cxx11_abi():
        return "this torch is built with the pre-C++11 string ABI, which cannot link a system librocksdb"
    return include, lib


def _rocksdb_extension(debug: bool) -> list:
    flag = _flag("VELOCE_ROCKSDB")
    if flag == "off":
        return []
    found = _find_rocksdb()
    if isinstance(found, str):
        if flag == "on":
            sys.exit(
                f"VELOCE_ROCKSDB=1 but RocksDB cannot be used: {found}. Install it "
                "(`apt-get install librocksdb-dev`) or set ROCKSDB_ROOT to a prefix with include/ and lib/."
            )
        print(f"[veloce] veloce._rocksdb not built (the RocksDB tier is unavailable): {found}", file=sys.stderr)
        return []
    include, lib = found
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    # The compiler's own directories stay implicit: naming /usr/include with -I reorders
    # the system headers.
    default_libs = {"/usr/lib", "/usr/lib64", os.path.join("/usr/lib", sysconfig.get_config_var("MULTIARCH") or "")}
    include_dirs = [] if include in ("/usr/include", "/usr/local/include") else [include]
    link = [] if lib in default_libs else [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    link.append("-lrocksdb")
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        cxx.append("-fopenmp")  # at::parallel_for splits a batch's MultiGet over threads
        link.append("-fopenmp")
    return [
        CppExtension(
            "veloce._rocksdb",
            [os.path.join("csrc", "storage", "rocksdb_store.cpp")],
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
            py_limited_api=True,
        )
    ]


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
    ] + _rocksdb_extension(debug)


setup(
    packages=find_packages(include=["veloce", "veloce.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
