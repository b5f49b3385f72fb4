"""Errors the offload layer raises for user-fixable problems (the CLI prints one line, exit 2)."""


class OffloadError(ValueError):
    """Impossible placement: not enough host or device memory, bad chunk size, ..."""
