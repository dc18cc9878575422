"""`python -m anchor VERB ...`: the `anchor` command (also what `torchrun -m anchor train ...` runs on every rank).

An entry point, not a module of the core: nothing imports it, so the floor rule (tests/test_layout.py)
leaves `__main__` files out; it hands the command to the application floor.
"""

from anchor_app.cli import main

main()
