"""anchor_app: the application floor of the toolkit (the top floor, docs/DESIGN.md §Architecture).

The `anchor` command line (`cli`, `commands`), the demo, evaluation (perplexity, RULER, lm-eval's
harness) and the benchmark. It stands on everything below it: the shared core (`anchor`), the oracle
(`jaxref`), the trainer (`torchtrain`) and what compares them (`parity_tests`); nothing below imports it.
"""
