"""Why our cwe and lm-eval's ruler_cwe differ (issue 15, Acceptance 3): the one-shot example.

    .venv/bin/python experiments/ruler_crosscheck/cwe_oneshot.py [--name cpu] [--model default] [--samples 10]
        [--lengths 1024,2048] [--threads N]

Upstream RULER's cwe prompt (scripts/data/synthetic/common_words_extraction.py), and ours, is a
one-shot example (a shorter word list and its answer "1. w1 2. w2 ...") followed by the question.
lm-eval 0.4.13's `ruler_cwe` builds the example too, sizes the prompt with it, and then leaves it out
(`cwe_utils.py` keeps `input_example` out of `input`), so its prompts are about half the length and
carry no example. This script decodes our cwe prompts as they are and with the example cut off (the
question alone, lm-eval's construction), same model, greedy, scored with RULER's string_match_all,
and counts how many predictions start by copying the example's answer words.

Writes results/ruler_cwe_oneshot_<name>.json beside it with the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository

from anchor.eval import ruler, scoring  # noqa: E402
from anchor.eval.generate import eval_model_source, greedy_generate, load_eval_model  # noqa: E402
from anchor_core.machine import machine  # noqa: E402
from anchor_core.tokenizer import load_tokenizer  # noqa: E402

QUESTION = "Below is a numbered list of words."  # upstream's template starts so, the example's and the question's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--note", default="2-core CPU shared with other jobs while it ran: runtimes are loaded-machine "
                                      "wall times; the scores do not depend on the load")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    source = eval_model_source(args.model)
    tok = load_tokenizer(source)
    model = load_eval_model(source, dtype=args.dtype)
    first = [tok.first_token_id]
    t0 = time.time()
    cells, detail = [], []
    for L in [int(x) for x in args.lengths.split(",")]:
        samples = ruler.generate("cwe", L - len(first), tok, args.samples)  # as anchor.eval.runner makes them
        variants = {}
        for s in samples:
            cut = s.input.index(QUESTION, 1)  # the second occurrence: the question after the example
            example_answers = s.input[:cut].rsplit("are:", 1)[1].split()[1::2]  # "1. w1 2. w2 ..." -> words
            variants.setdefault("with_example", []).append((s, s.prompt, example_answers))
            variants.setdefault("without_example", []).append((s, s.input[cut:] + s.answer_prefix, example_answers))
        for name, rows in variants.items():
            prompts = [first + ids for ids in tok.encode_batch([p for _, p, _ in rows])]
            outs = greedy_generate(model, tok, prompts, [s.tokens_to_generate for s, _, _ in rows],
                                   batch_size=args.batch_size, progress=True)
            preds = [tok.decode(o) for o in outs]
            copied = [bool(ex) and sum(w in p.split()[:20] for w in ex) >= 2 for (_, _, ex), p in zip(rows, preds)]
            cells.append({"length": L, "variant": name, "score": scoring.score("cwe", preds, [s.answers for s, _, _ in rows]),
                          "samples": len(rows), "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
                          "copies_example_answer": int(sum(copied))})
            detail += [{"length": L, "variant": name, "index": s.index, "answers": s.answers, "example_answers": ex,
                        "prediction": p} for (s, _, ex), p in zip(rows, preds)]
            print(json.dumps(cells[-1]))
    result = {"what": "issue 15 Acceptance 3: our cwe prompts with and without upstream's one-shot example "
                      "(lm-eval 0.4.13's ruler_cwe leaves it out)",
              "model": args.model, "dtype": args.dtype, "seed": 42, "cells": cells,
              "copies_example_answer": "predictions whose first 20 words hold at least 2 of the example's answer words",
              "runtime_s": round(time.time() - t0, 1), "machine": machine(), "note": args.note,
              "samples_detail": detail}
    out = HERE / "results" / f"ruler_cwe_oneshot_{args.name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
