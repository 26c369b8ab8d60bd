"""Build hook for the optional native hashing fast path; everything else is in pyproject.toml.

``epp.prefix._chainhash`` links against the system's libxxhash (``libxxhash.so.0``, present on
Debian and Ubuntu with rsync, or from the ``libxxhash0`` package); ``epp.prefix._lru`` is the
per-endpoint chunk LRU. Either may fail to build: the install still succeeds and epp uses the
pure-Python code (same results, slower).
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
        ),
        Extension(
            "epp.prefix._lru",
            sources=["epp/prefix/_lru.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
