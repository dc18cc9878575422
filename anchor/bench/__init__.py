"""`anchor bench`: what AnchorAttention costs against full attention, measured and modelled (docs/DESIGN.md §10).

    windows    document layouts to time: windows packed from a corpus, synthetic length distributions
    timing     attention forward + backward per engine x variant x length; peak memory
    step       a whole `anchor train` step per variant
    estimate   days per 1B tokens for a model, length, GPU count and variant (calibrated where measured)
    report     bench.json, report.md and the figures
    run        the whole benchmark (`run_bench`), as the CLI runs it

The FLOP model (query-key pairs each variant's mask allows, attention and step FLOPs) is anchor_core.flops,
which `anchor train` counts each step's MFU with too.
"""
