"""One module per `anchor` verb; each decorates its function with `@app.command(short_help=SUMMARY)`:
`SUMMARY` is the verb's one line in `anchor --help`, the docstring its description in `anchor VERB --help`."""
