"""RULER's 13 synthetic tasks, generated offline with the model's own tokenizer (docs/DESIGN.md §9).

    tok = load_tokenizer("default")
    samples = generate("niah_single_2", 4096, tok, n_samples=50, seed=42)
    s = samples[0]
    s.prompt                     # s.input + s.answer_prefix: what the model reads
    s.answers                    # the references `anchor.eval.scoring.score` matches
    s.prompt_tokens + s.tokens_to_generate <= 4096

Follows NVIDIA/RULER (`scripts/synthetic.yaml`, `scripts/data/synthetic/{constants,niah,
variable_tracking,common_words_extraction,freq_words_extraction,qa}.py`): the same task configs,
templates, answer prefixes, answer budgets (`tokens_to_generate`), needle and value formats, few-shot
examples and answer sets. `TASKS` holds the 13 configs, `FAMILIES` the templates.

Lengths. As upstream, a prompt's length counts its tokens without special tokens (a BOS the caller
adds is not counted), the answer prefix included, plus the answer budget. Upstream binary-searches one
haystack size per task and length, then backs each sample off in steps of 5 to 500 units when it
overflows, so its prompts can fall short by a step. Here every sample's random draws (keys, values,
depths, chains, word lists, distractor documents) are fixed first, as a plan, and its own haystack
size is searched (a secant estimate, then galloping and bisection on the exact token count), so
`prompt_tokens + tokens_to_generate` is the largest that is <= `length`: within one haystack unit of
it. Units: essay words, noise paragraphs ("The grass is green. ..."), distractor needles, cwe list
words, fwe text words, qa documents.

Deviations from upstream, and why:
- Essay haystack (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery): Paul Graham's
  essays are a download; the haystack is real prose from a local corpus instead. By default the
  embedded corpus (`anchor_core.data.corpus.default_corpus_documents`): its `prose` documents (the
  standard library's READMEs, NEWS and help pages), then its `docs` documents (the language
  reference topics `help()` shows), keeping only paragraphs of running text (at least 12 words, 80%
  of them plain words, one sentence end), about 410K characters, so prompts up to about 90K tokens
  never repeat text. `haystack=PATH` takes the user's text file, or JSONL with a "text" field, as is.
  As upstream, the haystack is a stream of words (whitespace normalised) from its start, repeated
  when a prompt needs more, split into sentences to place the needles between them; nltk's punkt is
  replaced by a regex splitter (a sentence ends at `.`, `!` or `?`, closing quotes or brackets
  allowed, before a word that starts with a capital, a digit or an opening quote).
- Words: upstream draws keys (`adjective-noun`) and cwe words from the `wonderwords` package, which
  is not installed; `anchor.eval.words` holds our own lists of common English adjectives (479), nouns
  (626) and verbs (485), so 300K keys. Where cwe needs more distinct words than the lists hold
  (upstream then switches to its 480K-word English dictionary; here from about 40K tokens on), it
  takes the distinct lowercase words of the whole embedded corpus as well (about 15K: English from
  its prose, docs and comments, and some standard-library identifiers), and those of a user haystack.
- qa_1/qa_2 read the SQuAD v2.0 dev JSON and the HotpotQA dev distractor JSON the user gives
  (`qa_data=`); upstream downloads them. Sample i asks question i, as upstream.
- Robustness where upstream leaves it to chance: keys of one sample are distinct and no distractor
  needle reuses a key of the sample; vt's variable names are distinct, and its few-shot example is
  renamed with one simultaneous substitution (upstream's successive `str.replace` can rename a name
  twice). Empty text between two needles at the same depth is not joined in (upstream joins an empty
  string, leaving a double space).
- Determinism: the draws of sample i come from `random.Random("ruler/<task>/<seed>/<i>")`, not from
  the length, so the samples of one seed at different lengths share keys, values and depths (paired
  comparisons across lengths); upstream's fixed-seed shuffles (needle order, cwe and fwe lists, qa
  documents) use `seed` as upstream uses `random_seed`.

The package mirrors upstream's files:
  tasks                     the templates and the 13 task configs (constants.py, synthetic.yaml):
                            `FAMILIES`, `TASKS`, `TASK_NAMES`, `task_config`
  common                    what the families share: a sample's plan, the fit of its haystack to the
                            length, the essay haystack (`Haystack`, `load_haystack`)
  niah                      niah_* (niah.py)
  variable_tracking         vt (variable_tracking.py)
  common_words_extraction   cwe (common_words_extraction.py)
  freq_words_extraction     fwe (freq_words_extraction.py)
  qa                        qa_1, qa_2 (qa.py; `load_qa`)
  prepare                   `generate` and `Sample`: a task's samples fitted to the length (prepare.py)
"""

from anchor.eval.ruler.common import Haystack, load_haystack
from anchor.eval.ruler.common_words_extraction import cwe_words
from anchor.eval.ruler.niah import key_words
from anchor.eval.ruler.prepare import Sample, generate
from anchor.eval.ruler.qa import load_qa
from anchor.eval.ruler.tasks import (
    DEPTHS,
    FAMILIES,
    NEEDLE,
    NOISE,
    QA_SOURCES,
    TASK_NAMES,
    TASKS,
    FamilyTemplate,
    TaskConfig,
    task_config,
)

# Other public names of the task modules, also read as `ruler.<name>` (outside `__all__`).
from anchor.eval.ruler.common import HAYSTACK_DOMAINS  # noqa: F401
from anchor.eval.ruler.freq_words_extraction import zeta  # noqa: F401
from anchor.eval.ruler.qa import QA  # noqa: F401
from anchor.eval.ruler.tasks import (  # noqa: F401
    DOCUMENT_PROMPT,
    CweArgs,
    Family,
    FweArgs,
    HaystackKind,
    NeedleKind,
    NiahArgs,
    QaArgs,
    QaSource,
    VtArgs,
)

__all__ = [
    "DEPTHS", "FAMILIES", "NEEDLE", "NOISE", "QA_SOURCES", "TASKS", "TASK_NAMES", "FamilyTemplate",
    "Haystack", "Sample", "TaskConfig", "cwe_words", "generate", "key_words", "load_haystack", "load_qa",
    "task_config",
]
