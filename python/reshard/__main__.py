"""`python -m reshard ARGS` runs the reshard CLI."""

from ._cli import main

main()
