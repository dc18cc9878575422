"""One module per `anchor` verb; each decorates its function with `@app.command()`."""
