"""triforce_offload.cli: the `triforce-offload` command line.

`app.py` holds the typer app and the entry point; the command modules import it and
register their command. Importing them here, and nowhere else, keeps the import graph
one-way: app <- run, plan, tune, bench, serve <- this package.
"""
# each registers its command on app.app
from . import run, tune, bench, plan, serve  # noqa: F401
