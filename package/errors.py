"""User-facing errors: the CLI prints these as one line and exits with code 2."""


class TriforceError(Exception):
    """A mistake in the user's input or environment (bad path, impossible budget, bad option)."""
