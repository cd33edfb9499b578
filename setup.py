"""Build hook for the one compiled piece: the assignment kernels (plain C, loaded with ctypes).

Everything else is declared in pyproject.toml. The extension is optional: without a C compiler the install
still succeeds and :mod:`symfuse.native` runs the torch version of each kernel (same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "symfuse.match._lapcore",
            sources=["src/symfuse/match/_lapcore.c"],
            extra_compile_args=["-O3", "-std=c99"],
            optional=True,
        )
    ]
)
