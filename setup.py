"""Builds moe_core._C: the C core (always), the CUDA kernels (when nvcc and a CUDA build of torch
are present), and the torch binding that registers the ops.

Environment:
  MOE_CORE_CUDA=1   require the CUDA build (fail if nvcc or CUDA torch is missing)
  MOE_CORE_CUDA=0   never build the CUDA kernels
  (unset)           build them whenever possible
  MOE_CORE_DEBUG=1  -O0 -g
  MOE_CORE_SANITIZE=1  -O1 -g with -fsanitize=address,undefined -fno-sanitize-recover=all on the C
                    core and the binding (CPU only: `make test-sanitize` builds it into
                    build/sanitize/, never in place; load it with libasan preloaded)
  TORCH_CUDA_ARCH_LIST  defaults to "8.0;9.0a": the portable sm_80 path and Hopper's sm_90a
"""
import glob
import os
import shutil

from setuptools import setup

# torch guesses CUDA_HOME from the nvcc on PATH; a wrapper script there (/usr/local/bin/nvcc) makes
# it guess /usr/local, which has no CUDA headers. Prefer the toolkit's own folder when it exists.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("MOE_CORE_DEBUG") == "1"
SANITIZE = os.environ.get("MOE_CORE_SANITIZE") == "1"
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                  "-fno-omit-frame-pointer"]
if SANITIZE:
    OPT = ["-O1", "-g"] + SANITIZE_FLAGS
else:
    OPT = ["-O0", "-g"] if DEBUG else ["-O3"]


def want_cuda() -> bool:
    flag = os.environ.get("MOE_CORE_CUDA", "").strip()
    import torch

    have = torch.version.cuda is not None and (
        cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    )
    if flag == "1" and not have:
        raise RuntimeError(
            "MOE_CORE_CUDA=1 but no CUDA build is possible: torch.version.cuda="
            f"{torch.version.cuda}, CUDA_HOME={cpp_extension.CUDA_HOME}"
        )
    return have if flag == "" else flag == "1"


def cublas_paths():
    """(include dir, lib dir) of the cuBLAS that torch's pip wheels ship (nvidia/cu*/ beside torch),
    or of the CUDA toolkit when it has cuBLAS itself. The router's gating GEMM links it."""
    import torch

    site = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    candidates = sorted(glob.glob(os.path.join(site, "nvidia", "cu*")), reverse=True)
    candidates += [os.path.join(site, "nvidia", "cublas")]
    if cpp_extension.CUDA_HOME:
        candidates.append(cpp_extension.CUDA_HOME)
    for root in candidates:
        inc = os.path.join(root, "include")
        for lib in (os.path.join(root, "lib"), os.path.join(root, "lib64")):
            if os.path.exists(os.path.join(inc, "cublas_v2.h")) and glob.glob(
                os.path.join(lib, "libcublas.so*")
            ):
                return inc, lib
    raise RuntimeError("CUDA build: cuBLAS (cublas_v2.h and libcublas.so) not found beside torch "
                       f"({site}/nvidia) nor in CUDA_HOME={cpp_extension.CUDA_HOME}")


def cublas_link_name(lib_dir: str) -> str:
    """-l argument for libcublas: the exact soname the wheel ships (libcublas.so.13), which has no
    unversioned libcublas.so link; plain "cublas" where the toolkit has one."""
    if os.path.exists(os.path.join(lib_dir, "libcublas.so")):
        return "cublas"
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(lib_dir, "libcublas.so.*")))
    return ":" + min(names, key=len)


class BuildExt(cpp_extension.BuildExtension):
    """Compiles the C11 core with the C compiler and its own flags, then the binding and kernels.

    torch's BuildExtension passes C++ flags (-std=c++17) to every non-CUDA source; the core is C11,
    so its objects are built here first and linked in as extra objects.
    """

    def build_extensions(self):
        c_sources = sorted(glob.glob(os.path.join("csrc", "*.c")))
        build_dir = os.path.join(self.build_temp, "c_core")
        macros = [("MOE_CORE_WITH_CUDA", "1")] if WITH_CUDA else []
        objects = self.compiler.compile(
            c_sources,
            output_dir=build_dir,
            macros=macros,
            extra_postargs=["-std=c11", "-fPIC", "-fopenmp", "-Wall", "-Wextra"] + OPT,
        )
        for ext in self.extensions:
            ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extensions()


def make_extension():
    cuda = want_cuda()
    if cuda and SANITIZE:
        raise RuntimeError("MOE_CORE_SANITIZE=1 builds the CPU kernels only: set MOE_CORE_CUDA=0")
    sources = sorted(glob.glob(os.path.join("csrc", "torch", "*.cpp")))
    cxx = ["-fopenmp"] + OPT
    define = []
    link = ["-fopenmp"] + (SANITIZE_FLAGS if SANITIZE else [])
    if cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        define.append(("MOE_CORE_WITH_CUDA", "1"))
        ext_cls = cpp_extension.CUDAExtension
        inc, lib = cublas_paths()
        # -idirafter: the toolkit's own CUDA headers keep precedence over the wheel's copies; only
        # what the toolkit lacks (cublas_v2.h) is found there.
        extra = {"cxx": cxx, "nvcc": ["--expt-relaxed-constexpr", "-lineinfo",
                                      "-Xcompiler", "-idirafter," + inc] + OPT}
        link += [f"-L{lib}", f"-l{cublas_link_name(lib)}", f"-Wl,-rpath,{lib}"]
    else:
        ext_cls = cpp_extension.CppExtension
        extra = {"cxx": cxx}
    ext = ext_cls(
        name="moe_core._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define,
        extra_compile_args=extra,
        extra_link_args=link,
    )
    return ext, cuda


EXT, WITH_CUDA = make_extension()
setup(ext_modules=[EXT], cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)})
