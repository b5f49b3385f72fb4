"""`python -m triforce_offload.cli` runs the command line."""
from .app import main

main()
