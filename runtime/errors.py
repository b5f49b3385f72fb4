"""User-facing errors: the CLI prints these as one line and exits with code 2."""
from ..errors import TriforceError  # noqa: F401  (defined at the root: kernels/ and options raise it too)
