"""`python -m jaxref.kernels`: build the native kernels (if needed) and print the library's path."""

import sys

from jaxref.kernels import KernelBuildError, build

try:
    print(build())
except KernelBuildError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
