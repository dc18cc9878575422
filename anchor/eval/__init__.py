"""Long-context evaluation (`anchor eval`, docs/DESIGN.md §9).

- `anchor.eval.ruler`: RULER's 13 synthetic tasks generated offline with the model's tokenizer
  (`ruler.generate`, `TASK_NAMES`, `Sample`; `generate` is not re-exported here: the name belongs to
  the submodule `anchor.eval.generate`); a package with one module per task family, as upstream's.
- `anchor.eval.scoring`: RULER's scores, 0-100 (`score`, `string_match_all`, `string_match_part`),
  and lm-evaluation-harness's variants beside them.
- `anchor.eval.words`: the word lists that stand in for `wonderwords`.
- `anchor.eval.generate` (greedy generation with a KV cache) and `anchor.eval.perplexity` need torch
  and are imported on their own.
"""

from anchor.eval.ruler import TASK_NAMES, TASKS, Sample, load_haystack, load_qa, task_config
from anchor.eval.scoring import (
    lm_eval_score,
    lm_eval_string_match_all,
    lm_eval_string_match_part,
    postprocess_pred,
    score,
    string_match_all,
    string_match_part,
    task_metric,
)

__all__ = [
    "TASK_NAMES", "TASKS", "Sample", "load_haystack", "load_qa", "task_config",
    "lm_eval_score", "lm_eval_string_match_all", "lm_eval_string_match_part", "postprocess_pred",
    "score", "string_match_all", "string_match_part", "task_metric",
]
