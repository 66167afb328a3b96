"""``python -m diloco`` is ``diloco-node``."""

from diloco.cli import main

main()
