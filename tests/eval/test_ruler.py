"""RULER's 13 tasks generated offline.

For every task at 1024, 1500 and 2048 tokens with SmolLM2's tokenizer: each prompt with its answer
budget is at most the target and within 2% of it, or within one haystack unit where a unit is larger;
the answers can be recovered from the prompt alone (the needles' values, the variable chain, the most
frequent words counted, the QA answer in its document); a perfect reader scores 100 and an empty one
0; a seed gives the same samples and another seed others. QA tasks read small hand-made files in the
SQuAD v2.0 and HotpotQA formats.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anchor_core.errors import InputError
from anchor.eval import ruler
from anchor.eval.ruler import NOISE, TASK_NAMES, generate
from anchor.eval.scoring import score
from anchor_core.paths import DEFAULT_MODEL_FILE, cache_dir
from anchor_core.tokenizer import load_tokenizer

pytestmark = pytest.mark.model

LENGTHS = (1024, 1500, 2048)
N_SAMPLES = 3


@pytest.fixture(scope="module")
def tok():
    path = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if not path.is_file():
        pytest.skip(f"{path} is missing (run `make install`)")
    return load_tokenizer(str(path))


# ---------------------------------------------------------------------------------------------
# Hand-made QA files in upstream's formats

TOWNS = ["Amberford", "Brindlemere", "Cobaltwick", "Dunharrow", "Elmstead", "Fallowmere", "Greywater",
         "Hollinsby", "Ivydale", "Juniper Cross", "Kestrelholm", "Larkspur Bay", "Millbrook", "Northwick",
         "Oakhurst", "Pendlebury", "Quarry Hill", "Redcastle"]
RIVERS = ["Wendle", "Saltmarsh", "Orrin", "Teal", "Brackwater", "Ashburn"]
PRODUCTS = ["blue cheese", "woollen blankets", "copper kettles", "cider", "rope", "glassware"]
FIRST = ["Edith", "Tobias", "Margery", "Silas", "Agnes", "Rowan", "Wilfred", "Honora", "Jasper"]
LAST = ["Fairweather", "Quill", "Ashdown", "Pennick", "Stroud", "Holloway", "Marchbank", "Tillotson"]


def _town(i: int) -> dict:
    founder = f"{FIRST[i % len(FIRST)]} {LAST[(i * 5) % len(LAST)]}"
    return {"town": TOWNS[i], "river": RIVERS[i % len(RIVERS)], "founder": founder,
            "year": 1100 + 37 * i, "product": PRODUCTS[(i * 7) % len(PRODUCTS)]}


def _paragraph(t: dict) -> list[str]:
    return [f"{t['town']} is a market town on the river {t['river']}.",
            f" It was founded in {t['year']} by {t['founder']}, who built the first mill there.",
            f" Today the town is known for its {t['product']}, which are sold in markets across the region.",
            f" The town hall, rebuilt after a great fire, houses a small museum of local history."]


def _squad(path: Path) -> Path:
    data = []
    for a in range(3):  # three articles of six paragraphs: a question's article gives its more_context
        paragraphs = []
        for i in range(6 * a, 6 * a + 6):
            t = _town(i)
            surname = t["founder"].split()[-1]
            paragraphs.append({"context": "".join(_paragraph(t)), "qas": [
                {"id": f"q{i}", "question": f"Who founded {t['town']}?", "is_impossible": False,
                 "answers": [{"text": t["founder"], "answer_start": 0}, {"text": surname, "answer_start": 0}]},
                {"id": f"u{i}", "question": f"Who closed the mill of {t['town']}?", "is_impossible": True,
                 "answers": [], "plausible_answers": [{"text": t["founder"], "answer_start": 0}]},
            ]})
        data.append({"title": f"Towns {a}", "paragraphs": paragraphs})
    path.write_text(json.dumps({"version": "v2.0", "data": data}), encoding="utf-8")
    return path


def _hotpot(path: Path) -> Path:
    records = []
    for i in range(8):
        t = _town(i)
        others = [(i + k) % len(TOWNS) for k in (3, 7, 11)]
        context = [[t["town"], _paragraph(t)]] + [[TOWNS[j], _paragraph(_town(j))] for j in others]
        records.append({"_id": f"h{i}", "type": "bridge", "level": "easy",
                        "question": f"Which river flows through the town founded by {t['founder']}?",
                        "answer": t["river"], "supporting_facts": [[t["town"], 0], [t["town"], 1]],
                        "context": context})
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def qa_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("qa")
    return {"qa_1": _squad(folder / "dev-v2.0.json"), "qa_2": _hotpot(folder / "hotpot_dev_distractor_v1.json")}


def _generate(task, length, tok, qa_files, n=N_SAMPLES, seed=42, **kw):
    return generate(task, length, tok, n, seed=seed, qa_data=qa_files.get(task), **kw)


# ---------------------------------------------------------------------------------------------
# What the prompt alone says the answers are


def _niah_answers(s) -> list[str]:
    """The values of the queried keys' needles, read from the prompt."""
    found: dict[str, list[str]] = {}
    for key, value in re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", s.input):
        found.setdefault(key, []).append(value)
    m = re.fullmatch(r" The special magic \w+ for (.+) mentioned in the provided text (?:is|are)", s.answer_prefix)
    assert m, s.answer_prefix
    queries = re.split(r", and |, ", m.group(1))
    return [v for q in queries for v in found[q]]


def _vt_answers(s) -> list[str]:
    """The variables whose chain starts at the queried value, read from the question's text (the
    few-shot example before it left out)."""
    text = s.input[s.input.rindex("Memorize and track"):]
    value = re.search(r"assigned the value (\d+) in the text above\.$", text).group(1)
    assigned = dict(re.findall(r"^VAR (\w+) = (\d+|VAR \w+) ?$", text, flags=re.M))
    names = {v for v, rhs in assigned.items() if rhs == value}
    while True:
        more = {v for v, rhs in assigned.items() if rhs.startswith("VAR ") and rhs[4:] in names}
        if more <= names:
            return sorted(names)
        names |= more


def _most_common(words: list[str], k: int) -> list[str]:
    counts = Counter(words).most_common()
    assert counts[k - 1][1] > counts[k][1], f"a tie at rank {k}: {counts[:k + 1]}"
    return [w for w, _ in counts[:k]]


def _cwe_answers(s) -> list[str]:
    """The 10 most frequent words of the numbered list the question is about."""
    text = s.input[s.input.rindex("Memorize the ones that appear most often.\n"):s.input.rindex("\nQuestion:")]
    return _most_common(re.findall(r"\d+\. (\S+)", text), 10)


def _fwe_answers(s) -> list[str]:
    """The 3 most frequent coded words, the dots left out."""
    start = s.input.index("Find the three most frequently appeared coded words. ")
    text = s.input[start:s.input.rindex("\nQuestion:")]
    words = text.split(". ", 1)[1].split()
    return _most_common([w for w in words if w != "..."], 3)


def _unit_tokens(s, tok) -> int:
    """Tokens of one haystack unit where a unit can exceed 2% of the length: a noise paragraph, a
    distractor needle, a QA document; 0 elsewhere (essay words, list words)."""
    task = s.task
    if task in ("niah_single_1", "vt"):
        return len(tok.encode_batch(["\n" + NOISE])[0])
    if task in ("niah_multikey_2", "niah_multikey_3"):
        lines = re.findall(r"^One of the special magic .*$", s.input, flags=re.M)
        return max(len(ids) for ids in tok.encode_batch(["\n" + line for line in lines]))
    if task.startswith("qa_"):
        context = s.input[:s.input.rindex("\n\nAnswer the question based on the given documents.")]
        docs = re.split(r"\n\nDocument \d+:\n", context)[1:]
        return max(len(ids) for ids in tok.encode_batch([f"\n\nDocument {len(docs)}:\n{d}" for d in docs]))
    return 0


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", TASK_NAMES)
def test_prompts_fill_the_length_and_hold_the_answers(task, length, tok, qa_files):
    t0 = time.perf_counter()
    samples = _generate(task, length, tok, qa_files)
    per_sample = (time.perf_counter() - t0) / len(samples)
    budget = ruler.FAMILIES[ruler.TASKS[task].family].tokens_to_generate
    for s in samples:
        total = s.prompt_tokens + s.tokens_to_generate
        unit = _unit_tokens(s, tok)
        slack = max(0.02 * length, unit)
        print(f"{task} L={length} #{s.index}: prompt {s.prompt_tokens} + budget {s.tokens_to_generate} = {total}"
              f" (>= {length - slack:.0f}), haystack {s.haystack_size} units of <= {unit} tokens,"
              f" {per_sample * 1e3:.0f} ms/sample")
        assert (s.task, s.length, s.tokens_to_generate) == (task, length, budget)
        assert s.prompt_tokens == len(tok.encode_batch([s.input + s.answer_prefix])[0])
        assert length - slack <= total <= length
        family = ruler.TASKS[task].family
        if family == "niah":
            assert sorted(_niah_answers(s)) == sorted(s.answers)
        elif family == "variable_tracking":
            assert _vt_answers(s) == sorted(s.answers) and len(s.answers) == 5
        elif family == "common_words_extraction":
            assert sorted(_cwe_answers(s)) == sorted(s.answers)
        elif family == "freq_words_extraction":
            assert _fwe_answers(s) == s.answers
        else:
            assert any(a in s.input for a in s.answers)
        if family != "qa":
            assert all(a in s.input for a in s.answers)
    answers = [s.answers for s in samples]
    assert score(task, [" ".join(a) for a in answers], answers) == 100.0
    assert score(task, ["" for _ in answers], answers) == 0.0


@pytest.mark.parametrize("task", TASK_NAMES)
def test_a_seed_gives_the_same_samples(task, tok, qa_files):
    a = _generate(task, 1024, tok, qa_files, seed=7)
    b = _generate(task, 1024, tok, qa_files, seed=7)
    c = _generate(task, 1024, tok, qa_files, seed=8)
    assert [s.record() for s in a] == [s.record() for s in b]
    assert all(x.input != y.input for x, y in zip(a, c))
    # a sample does not depend on how many come after it
    assert [s.record() for s in _generate(task, 1024, tok, qa_files, n=1, seed=7)] == [a[0].record()]


def test_templates_follow_upstream(tok, qa_files):
    """One answer reads in the singular and several in the plural, as upstream rewrites its template."""
    one = _generate("niah_single_1", 1024, tok, qa_files, n=1)[0]
    four = _generate("niah_multivalue", 1024, tok, qa_files, n=1)[0]
    assert one.input.startswith("A special magic number is hidden within the following text. Make sure to "
                                "memorize it. I will quiz you about the number afterwards.\n")
    assert re.search(r"\nWhat is the special magic number for \S+ mentioned in the provided text\?$", one.input)
    assert one.answer_prefix.endswith("mentioned in the provided text is")
    assert four.input.startswith("Some special magic numbers are hidden")
    assert four.answer_prefix.endswith("mentioned in the provided text are") and len(four.answers) == 4
    uuid = _generate("niah_single_3", 1024, tok, qa_files, n=1)[0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uuid.answers[0])
    assert re.fullmatch(r"\d{7}", one.answers[0])
    vt = _generate("vt", 1024, tok, qa_files, n=1)[0]
    assert vt.answer_prefix.startswith(" Answer: According to the chain(s) of variable assignment in the text "
                                       "above, 5 variables are assgined the value ")  # upstream's typo
    assert vt.input.count("Memorize and track the chain(s)") == 2  # the few-shot example, then the question


def test_cwe_takes_the_haystack_words_beyond_its_list(tok, qa_files):
    """At 4096 and above cwe repeats its words 30 and 3 times (upstream); where it needs more distinct
    words than `cwe_words()` holds, it draws from the haystack's vocabulary as well."""
    small = set(ruler.cwe_words())
    s = _generate("cwe", 4096, tok, qa_files, n=1)[0]
    assert s.haystack_size < len(small) and set(s.answers) <= small
    assert sorted(_cwe_answers(s)) == sorted(s.answers)
    main = s.input[s.input.rindex("Memorize the ones"):]
    assert Counter(re.findall(r"\d+\. (\S+)", main))[s.answers[0]] == 30


def test_user_haystack(tok, qa_files, tmp_path):
    lines = [{"text": f"Paragraph {i} tells of the quiet harbour of Zanzibarian fishermen. They mend nets at "
                      f"dawn and sail at noon. Nobody counts the gulls. Number {i} ends here!"} for i in range(40)]
    jsonl = tmp_path / "hay.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in lines), encoding="utf-8")
    txt = tmp_path / "hay.txt"
    txt.write_text("\n\n".join(x["text"] for x in lines), encoding="utf-8")
    gz = tmp_path / "hay.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    parquet = tmp_path / "hay.parquet"
    pq.write_table(pa.table({"text": [x["text"] for x in lines]}), parquet)
    for path in (jsonl, txt, gz, parquet):  # the corpus readers' formats, and plain text
        s = _generate("niah_multiquery", 1500, tok, qa_files, n=1, haystack=path)[0]
        assert "Zanzibarian fishermen" in s.input and "grass is green" not in s.input
        assert sorted(_niah_answers(s)) == sorted(s.answers)
        assert s.prompt_tokens + s.tokens_to_generate >= 0.98 * 1500
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(InputError, match="bad.jsonl:2: text field 'text' is missing"):
        _generate("niah_single_2", 1024, tok, qa_files, haystack=tmp_path / "bad.jsonl")
    with pytest.raises(InputError, match="no such haystack file"):
        _generate("niah_single_2", 1024, tok, qa_files, haystack=tmp_path / "missing.txt")


def test_sentences_split_without_downloads():
    text = 'He left. "Stay," she said. It was 3 a.m. and (quiet). 42 boats! e.g. this? Yes.'
    hay = ruler.Haystack.from_text(text, "test")
    starts = hay.sentence_starts(len(hay.words))
    sentences = [" ".join(hay.words[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    print(sentences)
    assert sentences == ["He left.", '"Stay," she said.', "It was 3 a.m. and (quiet).", "42 boats! e.g. this?",
                         "Yes."]
    # needles go between sentences at their depths; the stream repeats past its end
    text = hay.with_needles(2 * len(hay.words), [0, 100], ["N1.", "N2."])
    assert text.startswith("N1. He left.") and text.endswith("Yes. N2.") and text.count("42 boats!") == 2


def test_bad_input(tok, qa_files, tmp_path):
    with pytest.raises(InputError, match=r"unknown RULER task 'niah_single_4' \(valid: niah_single_1, .*qa_2\)"):
        generate("niah_single_4", 1024, tok, 1)
    for task, what in (("qa_1", r"SQuAD v2.0 dev JSON \(dev-v2.0.json\): pass its path with --squad"),
                       ("qa_2", r"HotpotQA dev distractor JSON \(hotpot_dev_distractor_v1.json\): pass its path "
                                r"with --hotpotqa")):
        with pytest.raises(InputError, match=f"{task} needs the {what}") as e:
            generate(task, 1024, tok, 1)
        assert "\n" not in str(e.value)
        with pytest.raises(InputError, match="no such file"):
            generate(task, 1024, tok, 1, qa_data=tmp_path / "missing.json")
    (tmp_path / "squad.json").write_text('{"data": [{"paragraphs": [{"qas": []}]}]}', encoding="utf-8")
    with pytest.raises(InputError, match="not SQuAD"):
        generate("qa_1", 1024, tok, 1, qa_data=tmp_path / "squad.json")
    with pytest.raises(InputError, match="18 answerable questions, 19 samples"):
        generate("qa_1", 1024, tok, 19, qa_data=qa_files["qa_1"])
    with pytest.raises(InputError, match="does not fit in 150 tokens"):
        generate("niah_single_1", 150, tok, 1)
    with pytest.raises(InputError, match="positive integer"):
        generate("vt", 0, tok, 1)
