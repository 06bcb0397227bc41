"""Build of the operator library `libsilverrec_ops.so` (sources in kernels/csrc/, installed in silverrec/kernels/).

All package metadata lives in pyproject.toml; this file only adds the library. It is a plain shared library
against libtorch (c10, torch, torch_cpu; no Python or pybind: `py_limited_api` leaves torch_python out), which
Python loads with `torch.ops.load_library` (kernels/library.py) and a C++ process dlopens or links. Compiled with
-march=native for the machine that builds it (the editable install in `make setup`), so AVX512-VNNI is used
where the CPU has it; SILVERREC_MARCH overrides -march (`make test-portable` builds x86-64-v4 and x86-64-v3, and
any ISAS named, under build/portable/ and runs the kernel tests on each: the paths this machine skips).

Without a C++ compiler the install fails here: silverrec's operators exist only in this library (their schemas,
CPU and Meta kernels), so nothing that runs a model (publish, load, serve) works without it.
"""

import os
from glob import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, library_paths

ops = CppExtension(
    "silverrec.kernels.libsilverrec_ops",
    sorted(glob("kernels/csrc/*.cpp")),
    py_limited_api=True,  # no libtorch_python: the library serves a process without Python too
    extra_compile_args=["-O3", "-g0", f"-march={os.environ.get('SILVERREC_MARCH', 'native')}", "-ffp-contract=off",
                        "-fopenmp"],
    extra_link_args=["-fopenmp", f"-Wl,-rpath,{library_paths()[0]}"],  # finds libtorch when dlopened alone
)

setup(ext_modules=[ops], cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)})
