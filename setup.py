"""Build of the optional C++ CPU fast paths (`silverrec.kernels._cpu`, sources in kernels/csrc/).

All package metadata lives in pyproject.toml; this file only adds the extension module. It is
compiled with -march=native for the machine that builds it (the editable install in `make setup`),
so AVX512-VNNI is used where the CPU has it. Set SILVERREC_NO_EXT=1 to skip it: the ops then run
their torch implementations (kernels/*.py load the extension lazily and fall back with a warning).
SILVERREC_MARCH overrides -march (`make test-portable` builds x86-64-v4 and x86-64-v3, and any ISAS
named, under build/portable/ and runs the kernel tests on each: the fallback paths this machine skips).
"""

import os
from glob import glob

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("SILVERREC_NO_EXT") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext_modules = [
        CppExtension(
            "silverrec.kernels._cpu",
            sorted(glob("kernels/csrc/*.cpp")),
            extra_compile_args=["-O3", f"-march={os.environ.get('SILVERREC_MARCH', 'native')}", "-ffp-contract=off", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        )
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
