"""Build hook for the optional native hashing fast path; everything else is in pyproject.toml.

``epp.prefix._chainhash`` links against the system's libxxhash (``libxxhash.so.0``, present on
Debian and Ubuntu with rsync, or from the ``libxxhash0`` package). If it cannot be built, the
install still succeeds and epp uses the pure-Python loop (same hashes, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "epp.prefix._chainhash",
            sources=["epp/prefix/_chainhash.c"],
            extra_compile_args=["-O2"],
            extra_link_args=["-l:libxxhash.so.0"],
            optional=True,
        )
    ]
)
