from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ump._ucore",
            sources=["csrc/common.c", "csrc/arena.c", "csrc/cuda.c", "csrc/vmm.c", "csrc/lookup.c", "csrc/module.c"],
            depends=["csrc/ump.h", "csrc/internal.h", "csrc/cudadrv.h"],
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=default"],
            libraries=["dl", "pthread"],
        )
    ]
)
