"""The client's one compiled part, ``cached_client._gather`` (FastLoader's local reads in C,
docs/decisions.md D32). ``optional``: where it cannot be built (no C compiler), the
install still succeeds and the loaders use the same reads in Python."""

import platform

from setuptools import Extension, setup

sources = ["csrc/_gather.c"]
macros = []
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    # XXH3 picks SSE2, AVX2 or AVX-512 at run time: a build for the baseline ISA, fast on each.
    sources.append("csrc/xxhash/xxh_x86dispatch.c")
    macros.append(("CACHED_X86_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "cached_client._gather",
            sources,
            include_dirs=["csrc/xxhash"],
            define_macros=macros,
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
