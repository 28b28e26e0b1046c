"""``python -m cached``."""

from .cli import main

main()
