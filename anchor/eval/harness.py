"""`anchor eval --harness lm-eval`: lm-evaluation-harness's own tasks on our model.

    res = run_harness([("default", "default")], tasks=("niah_single_1", "vt"), lengths=(1024, 2048), limit=10)
    res["rows"]     # [{checkpoint, task, harness_task, length, score (0-100), samples, metric}]

What runs. lm-eval (0.4.13, the `eval` extra) through its Python API, `lm_eval.simple_evaluate`, with
`AnchorLM`, a small `lm_eval.api.model.LM` around the torchtrain model (`load_eval_model`) and
`greedy_generate`: the same weights, engine, dtype, first token (`Tok.first_token_id`: the BOS, else
the EOS) and greedy decoding as our own RULER, so the two sets of numbers differ only by the prompts
(lm-eval builds its own; its cwe, unlike upstream RULER's and ours, leaves out the one-shot example).

  RULER      the six tasks lm-eval builds offline (`HARNESS_RULER`: niah_single_1, niah_multikey_2/3,
             ruler_vt, ruler_cwe, ruler_fwe; the essay and QA tasks need downloads), one
             `simple_evaluate` per length with metadata {"max_seq_lengths": [L], "tokenizer": DIR}
             (lm-eval sizes its prompts with `AutoTokenizer.from_pretrained(DIR)`, so a GGUF
             tokenizer is written as a folder first, `tokenizer_folder`). lm-eval generates 500
             prompts per length and `limit` keeps the first N. Score: lm-eval's string_match_all × 100.
             Its TaskManager indexes only lm-eval's ruler folder (or the staged local YAMLs): its
             whole task index costs about 10 s of CPU per build. `nltk.download`, which lm-eval's
             RULER module calls on import, is skipped (`_import_ruler_offline`).
  local      `mmlu`, `hellaswag`, `longbench` from the task YAMLs under configs/eval/ (dataset_path:
             json) on the user's JSONL files in `--harness-data DIR` (`LOCAL_TASKS` names each file
             and its fields); a missing file is a one-line InputError naming it. Score: acc (MMLU),
             acc_norm (HellaSwag), QA F1 (LongBench's multi-document QA) × 100.

`AnchorLM` implements `generate_until` (greedy, stops at EOS, the budget `max_gen_toks`, then cut at
the first `until` string), `loglikelihood` (one full forward per request: the continuation's summed
log-probabilities in float32 and whether it is the greedy continuation; tokens split as lm-eval's
HFLM splits them) and `loglikelihood_rolling` (disjoint windows of the model's length).
"""

from __future__ import annotations

import importlib.util
import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anchor.eval import generate
from anchor.eval.generate import eval_model_source
from anchor_core import shipped
from anchor_core.errors import InputError, UnavailableError
from anchor_core.export import write_tokenizer
from anchor_core.paths import cache_dir, resolve_model_name
from anchor_core.tokenizer import Tok, load_tokenizer
from anchor_core.weights import load_spec

HARNESSES = ("lm-eval",)
# our RULER task name -> lm-eval's task of the same construction (the six that build offline)
HARNESS_RULER = {
    "niah_single_1": "niah_single_1",
    "niah_multikey_2": "niah_multikey_2",
    "niah_multikey_3": "niah_multikey_3",
    "vt": "ruler_vt",
    "cwe": "ruler_cwe",
    "fwe": "ruler_fwe",
}
CONFIGS = shipped.folder("eval")  # the local tasks' YAMLs and harness_utils.py, shipped in the wheel
DATA_PLACEHOLDER = "__DATA__"  # replaced by the --harness-data folder in the shipped YAMLs


@dataclass(frozen=True)
class LocalTask:
    """A task of configs/eval/: its YAML, lm-eval task name, data file under --harness-data, fields, metric."""

    yaml: str
    harness_task: str
    data: str
    fields: str
    metric: str


LOCAL_TASKS = {
    "mmlu": LocalTask("mmlu_local.yaml", "mmlu_local", "mmlu.jsonl",
                      "question, choices (4 strings), answer (0-3), subject (cais/mmlu, split test)", "acc"),
    "hellaswag": LocalTask("hellaswag_local.yaml", "hellaswag_local", "hellaswag.jsonl",
                           "activity_label, ctx_a, ctx_b, endings (4 strings), label (0-3) "
                           "(Rowan/hellaswag, split validation)", "acc_norm"),
    "longbench": LocalTask("longbench_local.yaml", "longbench_local", "longbench.jsonl",
                           "input, context, answers (list), dataset (hotpotqa, 2wikimqa or musique) "
                           "(THUDM/LongBench data/*.jsonl)", "score"),
}
DEFAULT_HARNESS_TASKS = tuple(HARNESS_RULER)


def available() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def require() -> None:
    if not available():
        raise UnavailableError('--harness lm-eval needs lm-evaluation-harness: pip install -e ".[eval]" '
                               '(lm-eval[ruler]==0.4.13)')


def check_tasks(tasks: Sequence[str], data_dir: str | Path | None) -> None:
    """Unknown harness tasks and missing local data: a one-line InputError naming what is missing."""
    valid = [*HARNESS_RULER, *LOCAL_TASKS]
    for t in tasks:
        if t not in valid:
            raise InputError(f"--harness-tasks: unknown task {t!r} (valid: {', '.join(valid)})")
    for t in tasks:
        if t not in LOCAL_TASKS:
            continue
        lt = LOCAL_TASKS[t]
        if data_dir is None:
            raise InputError(f"--harness-tasks {t} needs its data: --harness-data DIR holding {lt.data} "
                             f"(JSONL: {lt.fields})")
        if not (Path(data_dir) / lt.data).is_file():
            raise InputError(f"--harness-tasks {t}: no {lt.data} in --harness-data (JSONL: {lt.fields})",
                             path=data_dir)
        check_local_data(t, Path(data_dir) / lt.data)


def _strings(n: int | None = None):
    def ok(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(s, str) for s in v) and (n is None or len(v) == n) and bool(v)
    return ok


def _index(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 3) or (isinstance(v, str) and v in "0123" and v != "")


_STR = (lambda v: isinstance(v, str), "a string")
# per local task: field -> (check, what it must be, required); the fields configs/eval/*_local.yaml read
LOCAL_FIELDS: dict[str, dict[str, tuple[Any, str, bool]]] = {
    "mmlu": {"question": (*_STR, True), "choices": (_strings(4), "a list of 4 strings", True),
             "answer": (_index, "an index 0-3", True), "subject": (*_STR, False)},
    "hellaswag": {"activity_label": (*_STR, True), "ctx_a": (*_STR, True), "ctx_b": (*_STR, True),
                  "endings": (_strings(4), "a list of 4 strings", True), "label": (_index, "an index 0-3", True)},
    "longbench": {"input": (*_STR, True), "context": (*_STR, True),
                  "answers": (_strings(), "a non-empty list of strings", True),
                  "dataset": (lambda v: v in ("hotpotqa", "2wikimqa", "musique"), "hotpotqa, 2wikimqa or musique",
                              True)},
}


def check_local_data(task: str, path: Path) -> int:
    """Every line of a local task's JSONL read and checked before any work (not a traceback after the whole
    RULER evaluation): an InputError naming the file, the line and the field.
    Returns the number of records."""
    fields = LOCAL_FIELDS[task]
    count = 0
    try:
        handle = open(path, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", path=path) from None
    with handle:
        try:
            for n, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise InputError(f"line {n}: not JSON ({e.msg})", path=path) from None
                if not isinstance(rec, dict):
                    raise InputError(f"line {n}: a JSON object is expected, got {type(rec).__name__}", path=path)
                for name, (ok, what, required) in fields.items():
                    if name not in rec:
                        if required:
                            raise InputError(f"line {n}: no field {name!r} ({task} needs {LOCAL_TASKS[task].fields})",
                                             path=path)
                    elif not ok(rec[name]):
                        raise InputError(f"line {n}: field {name!r} must be {what}", path=path)
                count += 1
        except UnicodeDecodeError as e:
            raise InputError(f"not UTF-8 text (invalid byte at offset {e.start} of a line)", path=path) from None
    if count == 0:
        raise InputError(f"no records ({task} needs JSONL: {LOCAL_TASKS[task].fields})", path=path)
    return count


# ---------------------------------------------------------------------------------------------
# The tokenizer as a folder


def tokenizer_folder(source: str) -> Path:
    """A Hugging Face folder with the tokenizer of the model `source` (docs/DESIGN.md §6), as lm-eval's RULER
    loads it: the model's own folder when it has a tokenizer.json, else the tokenizer written once
    under `cache_dir()/harness_tokenizers/<identity>` (GGUF and random:<preset>)."""
    import os
    import shutil


    name = resolve_model_name(source)
    if Path(name).is_dir() and (Path(name) / "tokenizer.json").is_file():
        return Path(name)
    folder = cache_dir() / "harness_tokenizers" / load_tokenizer(source).identity[:24]
    if not (folder / "tokenizer.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            write_tokenizer(source, load_spec(name), work)
            os.replace(work, folder)  # whole or not at all; a concurrent writer's folder is as good
        except OSError:
            if not (folder / "tokenizer.json").is_file():
                raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return folder


# ---------------------------------------------------------------------------------------------
# The model as lm-eval sees it


def _lm_base() -> type:
    require()
    from lm_eval.api.model import LM

    return LM


def _cut(text: str, until: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string (as lm-eval's generate_until cuts)."""
    for u in until:
        if u:
            text = text.split(u, 1)[0]
    return text


def decode_ids(tokenizer: Tok, ids: Sequence[int]) -> str:
    """`tokenizer.decode` of generated ids, without ids past the tokenizer's vocabulary: a random preset's
    model has more embedding rows (331) than its byte tokenizer has ids (259), and those ids are no text."""
    return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size])


def make_lm(model: nn.Module, tokenizer: Tok, *, max_length: int, batch_size: int = 4, progress: bool = False):
    """An `lm_eval.api.model.LM` over a torchtrain model (`load_eval_model`) and its tokenizer.

    Args:
      model: the torchtrain model; generation runs `anchor.eval.generate.greedy_generate`.
      tokenizer: the model's tokenizer; its `first_token_id` (the BOS, else the EOS) goes in front of
        every context, as our RULER puts it (`anchor.eval.runner`).
      max_length: the model's positions: contexts are cut from the left to fit with their budget.
      batch_size: prompts per forward of generation.
    """
    LM = _lm_base()

    class AnchorLM(LM):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.tok = model, tokenizer
            self.max_length, self.batch_size = max_length, batch_size
            self.prefix = [tokenizer.first_token_id]  # what our RULER puts first (runner._prompts)

        # -- generation ------------------------------------------------------------------------
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            contexts, budgets, untils = [], [], []
            for req in requests:
                context, kwargs = req.args
                kwargs = dict(kwargs or {})
                if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
                    raise InputError("the lm-eval bridge decodes greedily; a task asked for sampling "
                                     f"({kwargs})")
                until = kwargs.get("until") or []
                untils.append([until] if isinstance(until, str) else list(until))
                budgets.append(int(kwargs.get("max_gen_toks", 256)))
                contexts.append(context)
            prompts = []
            for ids, budget in zip(self.tok.encode_batch(contexts), budgets):
                keep = max(1, self.max_length - budget - len(self.prefix))
                prompts.append(self.prefix + ids[-keep:])
            outs = generate.greedy_generate(self.model, self.tok, prompts, budgets, batch_size=self.batch_size,
                                   progress=progress and not disable_tqdm)
            return [_cut(decode_ids(self.tok, o), u) for o, u in zip(outs, untils)]

        # -- scoring ---------------------------------------------------------------------------
        def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            # as HFLM: trailing spaces of the context move to the continuation, and the continuation's
            # ids are those of (context + continuation) after the context's
            n = len(context) - len(context.rstrip())
            if n:
                context, continuation = context[:-n], context[-n:] + continuation
            whole, ctx = self.tok.encode_batch([context + continuation, context])
            return self.prefix + ctx, whole[len(ctx):]

        def _logprobs(self, ids: list[int], n_cont: int) -> tuple[float, bool]:
            """Sum of log p(continuation) and whether greedy decoding gives it: ids = context + continuation."""
            ids = ids[-(self.max_length + 1):]
            inp = torch.tensor([ids[:-1]])
            with torch.inference_mode():
                logits_TV = self.model(input_ids=inp, use_cache=False).logits[0, -n_cont:].float()
            logp_TV = torch.log_softmax(logits_TV, dim=-1)
            target = torch.tensor(ids[-n_cont:])
            total = float(logp_TV.gather(1, target[:, None]).sum())
            return total, bool((logp_TV.argmax(dim=-1) == target).all())

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            out = []
            for req in requests:
                context, continuation = req.args
                ctx, cont = self._split(context, continuation)
                if not cont:
                    raise InputError(f"lm-eval asked for the likelihood of an empty continuation after {context[-40:]!r}")
                out.append(self._logprobs(ctx + cont, len(cont)))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            out = []
            prefix = self.prefix[0] if self.prefix else self.tok.eos_id
            for req in requests:
                (text,) = req.args
                total = 0.0
                for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                        token_list=self.tok.encode_batch([text])[0], prefix_token=prefix,
                        max_seq_len=self.max_length, context_len=1)):
                    total += self._logprobs(list(ctx) + list(cont), len(cont))[0]
                out.append(total)
            return out

    return AnchorLM()


# ---------------------------------------------------------------------------------------------
# Running


def _stage_local(tasks: Sequence[str], data_dir: Path, into: Path) -> None:
    """The YAMLs of the local tasks with their data path filled in, and their helper module, into `into`."""
    import shutil

    for t in tasks:
        lt = LOCAL_TASKS[t]
        text = (CONFIGS / lt.yaml).read_text(encoding="utf-8")
        (into / lt.yaml).write_text(text.replace(DATA_PLACEHOLDER, str(data_dir.resolve())), encoding="utf-8")
    shutil.copyfile(CONFIGS / "harness_utils.py", into / "harness_utils.py")


def _import_ruler_offline() -> None:
    """Import lm-eval's RULER data module without the download it tries on import.

    `lm_eval.tasks.ruler.prepare_niah` calls `nltk.download("punkt_tab")` when punkt_tab is missing and
    then prints "Downloaded punkt_tab" to stdout even when the download failed. Only the essay tasks
    use punkt_tab, and they are not among `HARNESS_RULER`; the download is skipped, its print dropped."""
    import contextlib
    import io
    import sys

    if "lm_eval.tasks.ruler.prepare_niah" in sys.modules:
        return
    import nltk

    saved = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import lm_eval.tasks.ruler.prepare_niah  # noqa: F401
    finally:
        nltk.download = saved


def _sample_rows(res: dict[str, Any], name: str, metric: str, tok: Tok) -> list[dict[str, Any]]:
    """Per logged sample: index, prompt_tokens (what the model read: the first token and the context, for
    generation tasks), prediction, answers, score."""
    rows = []
    for s in res.get("samples", {}).get(name, []):
        doc = s.get("doc", {})
        resp = s.get("filtered_resps") or s.get("resps")
        pred = resp[0] if resp and isinstance(resp[0], str) else None  # (multiple choice: log-likelihoods)
        args = s.get("arguments") or [()]
        context = args[0][0] if pred is not None and args[0] and isinstance(args[0][0], str) else None
        rows.append({"index": s.get("doc_id"),
                     "prompt_tokens": None if context is None else 1 + len(tok.encode_batch([context])[0]),
                     "prediction": pred, "answers": doc.get("outputs", doc.get("answers")), "score": s.get(metric)})
    return rows


def run_harness(sources: Sequence[tuple[str, str]], *, tasks: Sequence[str] = DEFAULT_HARNESS_TASKS,
                lengths: Sequence[int] = (1024, 2048), limit: int = 10, data_dir: str | Path | None = None,
                engine: str = "sdpa", dtype: str = "bfloat16", batch_size: int = 4,
                progress: bool = False) -> dict[str, Any]:
    """lm-eval's tasks on every (label, model source) of `sources`.

    Args:
      sources: (label, model) pairs as `anchor.eval.runner.run_eval` takes them.
      tasks: our RULER names of `HARNESS_RULER` and/or `LOCAL_TASKS` names.
      lengths: RULER lengths (the local tasks run once, length None).
      limit: samples per task (and length): lm-eval's `limit`.
      data_dir: the folder of the local tasks' JSONL files.
    Returns:
      eval.json's "harness": rows (checkpoint, task, harness_task, length, score 0-100, samples,
      metric), samples (per sample: checkpoint, task, length, index, prompt_tokens, prediction,
      answers, score), settings, version, runtime_s.
    """
    import contextlib
    import sys
    import time


    require()
    check_tasks(tasks, data_dir)
    if limit < 1:
        raise InputError(f"--samples must be >= 1, got {limit}")
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.time()
    ruler = [t for t in tasks if t in HARNESS_RULER]
    if ruler:
        _import_ruler_offline()
    local = [t for t in tasks if t in LOCAL_TASKS]
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="anchor-harness-") as staged:
        if local:
            _stage_local(local, Path(data_dir), Path(staged))
        for label, source in sources:
            src = eval_model_source(source)
            spec = load_spec(src)
            for L in lengths:
                if L > spec.max_position:
                    raise InputError(f"--lengths: {L} is longer than the model's {spec.max_position} positions")
            tok = load_tokenizer(src)
            lm = make_lm(generate.load_eval_model(src, engine=engine, dtype=dtype), tok, max_length=spec.max_position,
                         batch_size=batch_size, progress=progress)
            tok_dir = str(tokenizer_folder(src))
            runs = [(L, [HARNESS_RULER[t] for t in ruler]) for L in lengths] if ruler else []
            if local:
                runs.append((None, [LOCAL_TASKS[t].harness_task for t in local]))
            for L, names in runs:
                # the metadata reaches RULER's dataset builders only through the TaskManager; it indexes
                # only the folder it needs (all of lm-eval's thousands of task YAMLs take ~10 s of CPU)
                metadata = {"max_seq_lengths": [L], "tokenizer": tok_dir} if L else {}
                folder = Path(lm_eval.__file__).parent / "tasks" / "ruler" if L else Path(staged)
                manager = TaskManager(include_path=str(folder), include_defaults=False, metadata=metadata)
                # lm-eval's RULER builders print their search to stdout, which is `anchor eval`'s report
                with contextlib.redirect_stdout(sys.stderr):
                    res = lm_eval.simple_evaluate(model=lm, tasks=names, limit=limit, task_manager=manager,
                                                  log_samples=True, bootstrap_iters=0)
                for ours, name in zip(ruler if L else local, names):
                    metric = str(L) if L else LOCAL_TASKS[ours].metric
                    value = res["results"][name][f"{metric},none"]
                    rows.append({"checkpoint": label, "task": ours, "harness_task": name, "length": L,
                                 "score": round(100.0 * float(value), 2),
                                 "samples": int(res["n-samples"][name]["effective"]), "metric": metric})
                    samples += [{"checkpoint": label, "task": ours, "length": L, **r}
                                for r in _sample_rows(res, name, metric, tok)]
            del lm
    return {"harness": "lm-eval", "version": lm_eval.__version__,
            "rows": rows, "samples": samples,
            "settings": {"tasks": list(tasks), "lengths": list(lengths), "limit": limit, "engine": engine,
                         "dtype": dtype, "batch_size": batch_size, "first_token": "bos, else eos",
                         "data_dir": None if data_dir is None else str(data_dir),
                         "scoring": "lm-eval's: RULER string_match_all, MMLU acc, HellaSwag acc_norm, "
                                    "LongBench QA F1; x 100"},
            "runtime_s": round(time.time() - t0, 1)}


def render_table(harness: dict[str, Any]) -> str:
    """report.md's section: one row per checkpoint × task, one column per length (or `score`)."""
    cols = list(dict.fromkeys(r["length"] for r in harness["rows"]))
    head = ["checkpoint", "task", *[("score" if c is None else str(c)) for c in cols]]
    lines = ["## lm-evaluation-harness (its own prompts, our model)", "",
             f"lm-eval {harness['version']}, {harness['settings']['limit']} samples per task and length; "
             f"scores 0–100 ({harness['settings']['scoring']}). Runtime {harness['runtime_s']:.0f} s.", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    keys = list(dict.fromkeys((r["checkpoint"], r["task"], r["harness_task"]) for r in harness["rows"]))
    for ck, task, name in keys:
        by = {r["length"]: r["score"] for r in harness["rows"] if (r["checkpoint"], r["task"]) == (ck, task)}
        lines.append(f"| {ck} | {name} | " + " | ".join(f"{by[c]:.1f}" if c in by else "-" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def binomial_se(score: float, n: int) -> float:
    """Sampling error of a score (0-100) over n samples: sqrt(p (1 - p) / n) × 100."""
    p = min(max(score / 100.0, 0.0), 1.0)
    return 100.0 * math.sqrt(p * (1.0 - p) / n) if n > 0 else float("nan")


__all__ = ["DEFAULT_HARNESS_TASKS", "HARNESSES", "HARNESS_RULER", "LOCAL_TASKS", "available",
           "binomial_se", "check_tasks", "decode_ids", "make_lm", "render_table", "require", "run_harness",
           "tokenizer_folder"]
