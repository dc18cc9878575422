"""`anchor bench` with sizes that cannot fit: refused before any work, in one line naming the option and
the estimate. The comments and docstrings say what happens without the check."""

from __future__ import annotations


import pytest

from anchor_core.errors import InputError
from tests.bench.helpers import corpus as _corpus, run_bench as _run


# ---------------------------------------------------------------------------------------------
# 2. Sizes bounded before allocation


@pytest.fixture
def eight_gib(monkeypatch):
    """8 GiB available here, whatever the machine has (`anchor_core.limits.available_memory`, which the bench's
    check and the packer's read)."""
    import anchor_core.limits

    monkeypatch.setattr(anchor_core.limits, "available_memory", lambda: 8 << 30)
    return 8 << 30


@pytest.mark.parametrize("args, needle", [
    # the training-step rows: unchecked, this cuts the model and packs the corpus, then the packer refuses
    # `--seq-len 100000000 (packing a window)`, an option not given (where more memory is free, it goes on
    # to 13 GB before failing)
    (["--step-seq-len", "100000000", "--no-attention"], "--step-seq-len 100000000"),
    (["--step-seq-len", "88888887", "--no-attention", "--step-layers", "1"], "--step-seq-len 88888887"),
    # the attention rows: unchecked, a traceback (RuntimeError: can't allocate memory) after allocating
    # q, k and v, from the dense T x T masks
    (["--seq-len", "300001", "--engines", "sdpa", "--no-step", "--distributions", "slimpajama"],
     "--seq-len 300001"),
])
def test_sizes_that_cannot_fit_are_refused_before_any_work(tmp_path, monkeypatch, capsys, eight_gib, args, needle):
    monkeypatch.setenv("ANCHOR_CACHE", str(tmp_path / "cache"))
    corpus = _corpus(tmp_path / "docs.jsonl")
    out = tmp_path / "bench"
    r = _run(["--out", str(out), "--no-progress", "--model", "random:llama", "--data", str(corpus),
              "--estimate-seq-len", "4096", *args], capsys)
    print(r.output)
    assert r.exit_code == 2
    line = r.output.strip()
    assert len(line.splitlines()) == 1 and needle in line and "needs about" in line and "GiB" in line
    assert not out.exists() and not (tmp_path / "cache").exists()  # no work, nothing written


def test_the_estimate_grows_with_the_sizes_and_lets_small_ones_through(eight_gib):
    """The estimate of a step and of the attention rows: larger with more slots or layers, within 8 GiB
    for small sizes, refused in one line beyond."""
    from anchor.bench.memory import attention_memory, check_bench_memory, step_memory
    from anchor_core.weights import load_spec

    spec = load_spec("default")
    small = dict(model="default", seq_lens=[4099], engines=["varlen"], variants=["anchor"], windows=2,
                 attention=True, step=True, step_seq_len=None, step_layers=2, device="cpu", dtype="float32")
    check_bench_memory(spec, **small)  # 4099: about 1 GiB each, well within 8 GiB
    a, b = (step_memory(spec, t, 2).total for t in (4099, 8197))
    assert 0 < a < b < 2.5 * a
    assert step_memory(spec, 4099, 3).total > a  # more layers, more memory
    assert attention_memory(spec, 4099, "sdpa", 2).total > attention_memory(spec, 4099, "varlen", 2).total
    with pytest.raises(InputError, match=r"--step-seq-len 100003 .* needs about 1\d\.\d GiB"):  # 15.3
        check_bench_memory(spec, **{**small, "attention": False, "step_seq_len": 100003})
    with pytest.raises(InputError, match=r"--seq-len 300001 .* needs about"):  # varlen: 11.4 GiB, linear in T
        check_bench_memory(spec, **{**small, "step": False, "seq_lens": [4099, 300001]})
