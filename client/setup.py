"""The client's compiled parts: ``cached_client._gather`` (FastLoader's local reads in C,
docs/decisions.md D32) and ``cached_wire._tarscan`` (the daemon's one-pass tar index and
checksums of a downloaded shard file, cached/hot/scan.py). ``optional``: where they cannot
be built (no C compiler), the install still succeeds and the same work is done in Python."""

import platform

from setuptools import Extension, setup

dispatch = []
macros = []
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    # XXH3 picks SSE2, AVX2 or AVX-512 at run time: a build for the baseline ISA, fast on each.
    dispatch.append("csrc/xxhash/xxh_x86dispatch.c")
    macros.append(("CACHED_X86_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            f"{package}.{name}",
            [f"csrc/{name}.c", *dispatch],
            include_dirs=["csrc/xxhash"],
            define_macros=macros,
            extra_compile_args=["-O3"],
            optional=True,
        )
        for package, name in (("cached_client", "_gather"), ("cached_wire", "_tarscan"))
    ]
)
