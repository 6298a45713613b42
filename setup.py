"""Build of quantplug's optional native kernels; everything else is declared in pyproject.toml.

The extension is optional: where no C compiler is available the build skips it with a warning
and quantplug uses its pure-torch code paths, with the same results (see
_quantplug/observers/kernels.py).
"""

import sys

from setuptools import Extension, setup

if sys.platform == "win32":
    FLAGS = ["/O2", "/fp:precise"]
else:
    # exact float32 arithmetic: no contraction into fused multiply-adds, no fast-math
    FLAGS = ["-O3", "-std=c99", "-ffp-contract=off", "-fno-fast-math"]

setup(
    ext_modules=[
        Extension(
            "_quantplug.observers._histogram_kernels",
            ["core/_quantplug/observers/_histogram_kernels.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
