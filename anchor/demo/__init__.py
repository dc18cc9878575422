"""`anchor demo`: the paper's experiment end to end on the embedded default, small enough for a CPU.

Jobs, each in its own sub-folder of `--out`:
  top5     the oracle's next-token top-5 on a prompt next to transformers' own (GGUF loaded by
           transformers itself, eager attention, fp32)
  corpus   the embedded default corpus (`anchor corpus`)
  pack     the corpus's files cut at their natural boundaries (documents.py), tokenized and packed into
           windows that hold several documents each (`anchor pack`)
  audit    a short RoPE/bf16 precision audit (`anchor audit`, quick settings)
  train    short continued pre-training runs, AnchorAttention against full attention, on the packed
           windows (`anchor train`, the `varlen` engine, evaluation checkpoints as the paper's)
  parity   the trained anchor checkpoint in the trainer held against the oracle, layer by layer,
           forward and gradients (`anchor parity --grads`)
  eval     RULER on every run, averaged over its evaluation checkpoints, perplexity beside it
           (`anchor eval --run`)
  bench    attention time of anchor against full on packed windows, with the FLOP ratio (`anchor bench`)
and `index.html`: one page, a section per job, tables and figures inline, every link relative;
`summary.png`, the run's figures in one grid at the page's width. Training and evaluation run in bf16
where the machine has bf16 units, fp32 elsewhere (checks.choose_dtype; the page says which and why).

Jobs run in that order; `--jobs` selects some (their inputs come along: `eval` needs `train`,
which needs `pack`, which needs `corpus`). `--out` is a demo folder (anchor's marker, verb `demo`):
every job publishes its own sub-folder atomically and is recorded in `demo.json` with a
fingerprint of its settings, its inputs' fingerprints and anchor's version. A second run reuses
every job whose fingerprint still matches (`--fresh` redoes them); a killed demo keeps the jobs
it finished, and a killed training run resumes from its newest checkpoint. A demo folder an earlier version
wrote is reused the same way (settings.upgrade_record reads its demo.json).

The package, one module per concern:
  settings     the job names, `DemoSettings` and the profiles
  next_token   the top-5 check (`top5`, `print_top5`)
  jobs         the jobs (`RUNNERS`: job name -> function of the job context); train_job and eval_job
               hold the two long ones, job_context what every job is given
  documents    the corpus cut at natural boundaries; documents per window and where anchor and full differ
  pipeline     which jobs run (`jobs_to_run`), fingerprints, the record, `run_demo`; reuse (which finished jobs
               are reused), checks (the checks before any work, the dtype)
  page         `index.html` (its sections: sections) and `summary.png` (figures)
  summary      the profile's summary JSON (`paper_gpu.json`) and the reset comparison (bf16 against fp32)

Profiles (`--profile`, settings.PROFILES): `demo`, `paper-small` (the four variants at 4K, hours on a CPU) and
`paper-gpu` (SmolLM2-135M continued at 16K with a raised RoPE base in bf16 under ZeRO-1, the four variants and
intra_doc / intra_doc_reset again in fp32; its own jobs corpus, pack, train, eval; made for one GPU): runs
named `<variant>@fp32` train in float32 (settings.run_names).
"""

from anchor.demo.pipeline import check_jobs, fingerprints, jobs_to_run, read_record, run_demo
from anchor.demo.settings import DEFAULT_PROMPT, JOBS, PROFILES, DemoSettings

__all__ = ["DEFAULT_PROMPT", "JOBS", "PROFILES", "DemoSettings", "check_jobs", "fingerprints", "jobs_to_run",
           "read_record", "run_demo"]
