"""`python -m anchor VERB ...`: the `anchor` command (also what `torchrun -m anchor train ...` runs on every
rank)."""

from anchor.cli import main

main()
