"""`python -m anchor_app VERB ...`: the `anchor` command."""

from anchor_app.cli import main

main()
