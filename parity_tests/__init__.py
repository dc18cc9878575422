"""What compares the floor below: torchtrain (the trainer) against jaxref (the oracle), layer by layer, and
the precision audit of both.

Modules:
  cases    `Case` (model, variant, layout, policy, engine, seq_len), its inputs from the real packer
           (`case_inputs`), the fast subset and the full matrix
  runners  the registry of runners producing taps from a case (every torchtrain engine, transformers' own
           implementations as `hf:IMPLEMENTATION@STYLE`; register more: sequence-parallel layouts, new
           kernels, a user's function), and the one oracle cache (`oracle`; a case's: `oracle_taps`)
  emulations  the oracle's emulation of each engine's arithmetic (`EMULATIONS`: engine -> dtype policy)
  core     per-layer, per-tap errors (max-abs, relative L2, per-token KL), the pass rule, the first
           divergent (layer, tap), emulation fidelity; `hold`, the one judgement of every comparison
  suite    `run_case`, `judge_case`, `run_parity`, `build_cases`, `describe`
  report   parity.json, index.html with a layer-wise plot per case, summary.md (the suite's and
           `--stack hf`'s: one writer)
  grads    gradient and AdamW-step parity (`run_grad_case`)
  audit    the precision audit (`anchor audit`): the oracle's under each dtype policy (`run_audit`), and
           the torch stack's beside its emulation's (`audit.torch_stack`, `anchor audit --stack torch`)
  hf_stack  stock transformers (its own attention implementations, inputs packed as transformers expects)
           and users' attention functions against the oracle (`anchor parity --stack hf`): which variant
           each computes when asked for each, and the bf16 rule where it computes the one asked (a package:
           `run_hf_stack` in its __init__; stacks, subjects, inputs, runner, isolation, judge, rows)
  hf_report  its summary.md (the table of what each stack computes)
  planted_attention  users' attention functions for the tests: a correct one and planted defects

    from parity_tests.cases import Case
    from parity_tests.suite import run_case
    r = run_case(Case("random:llama", "anchor", "tags", "bf16", "sdpa", 97))
    r["pass"], r["first_divergence"]
"""
