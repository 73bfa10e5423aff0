from glob import glob

from setuptools import Extension, setup

# The limited API of CPython 3.10 (abi3): one wheel serves every CPython from
# 3.10 on. The module is small (csrc/module.c); the hooks are plain C.
LIMITED_API = 0x030A0000

setup(
    ext_modules=[
        Extension(
            "ump._ucore",
            # a file per job (docs/architecture.md); the order does not matter
            sources=sorted(glob("csrc/*.c")),
            depends=sorted(glob("csrc/*.h")),
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=default"],
            define_macros=[("Py_LIMITED_API", hex(LIMITED_API))],
            py_limited_api=True,
            libraries=["dl", "pthread"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
