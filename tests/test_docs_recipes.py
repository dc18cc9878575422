"""Every code block of README.md, docs/guides/*.md and docs/verbs/*.md runs as written, or as the declaration above
its fence says (tests/docs_recipes/recipes.py lists the directives and how each language runs): one test per block,
`PAGE:N` for the page's N-th block. A block declared `slow` (multi-process, long, or GPU-sized) runs under
`make test-all` only; its static checks (its declaration, the make targets it names) run in every suite. Then the
collector's own checks: planted broken blocks, declarations and synopses fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_recipes.recipes import (ROOT, Block, all_blocks, blocks, cli_options, command_lines, make_problems,
                                        output_shape, pages, ran_by_problems, run_block, split_comment,
                                        stray_declarations, usage_problems)

BLOCKS = all_blocks()


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] * ("slow" in b.directives))
                                   for b in BLOCKS])
def test_recipe(block: Block, tmp_path: Path) -> None:
    assert block.error is None, block.error
    run_block(block, tmp_path / "scratch")


def test_every_page_is_collected_and_every_declaration_is_valid() -> None:
    names = {str(p.relative_to(ROOT)) for p in pages()}
    assert "README.md" in names and "docs/guides/hf-trainer.md" in names and "docs/verbs/train.md" in names
    assert {b.page for b in BLOCKS} >= {"README.md", "docs/verbs/train.md"} and len(BLOCKS) >= 30
    bad = [b.error for b in BLOCKS if b.error]
    bad += [f"{p.relative_to(ROOT)} line {n}: a recipe declaration above no code block"
            for p in pages() for n in stray_declarations(p)]
    assert bad == []


def test_the_static_checks_of_every_block_hold() -> None:
    """What the slow blocks' runs would also find, checked without running them: the make targets they name and
    the tests they say run them."""
    bad = []
    for b in BLOCKS:
        if "ran-by" in b.directives:
            bad += ran_by_problems(b)
        if b.lang == "bash" and "ran-by" not in b.directives:
            bad += [p for line in command_lines(b.text, indented_continues="usage" in b.directives)
                    if split_comment(line)[0].startswith("make ") for p in make_problems(line)]
    assert bad == []


# ---------------------------------------------------------------------------------------------------------------
# the collector fails what it should


def page(tmp_path: Path, text: str) -> list[Block]:
    path = tmp_path / "page.md"
    path.write_text(text)
    return blocks(path, tmp_path)


def test_an_unknown_or_malformed_declaration_is_an_error(tmp_path: Path) -> None:
    found = page(tmp_path, "# A page\n\n<!-- recipe: fast -->\n```bash\necho hi\n```\n\n"
                           "<!-- recipe: sub hub \"my-model\" => \"{tiny_hf}\" -->\n```python\nprint('my-model')\n```\n\n"
                           "<!-- recipe: sub gpu \"cuda\" => \"cpu\" -->\n```bash\necho cpu\n```\n\n"
                           "<!-- recipe: usage; slow -->\n```bash\nanchor train --out R\n```\n\n"
                           "```yaml\na: 1\n```\n\n"
                           "```\nanchor train: error: something\n```\n\n"
                           "<!-- recipe: slow -->\n\nsome text\n\n```bash\necho hi\n```\n")
    assert [b.error for b in found] == [
        "page.md line 4: unknown recipe directive 'fast'",
        "page.md line 9: sub hub: 'my-model' is not a model hub id",
        "page.md line 14: sub: 'cuda' is not in the block",
        "page.md line 19: a usage block is only checked: it takes no other directive",
        "page.md line 23: a YAML block needs `config train` (it is checked as a config)",
        "page.md line 27: a block of output (no language) needs `ran-by` the test that holds that output",
        None,
    ]
    assert stray_declarations(tmp_path / "page.md") == [31]
    with pytest.raises(AssertionError, match="unknown recipe directive"):
        test_recipe(found[0], tmp_path)


def test_a_synopsis_that_drifted_from_the_cli_fails() -> None:
    cli = cli_options()
    assert usage_problems("anchor train --config C --out DIR [--progress] [--no-progress] [key=value ...]\n", cli) == []
    assert usage_problems("anchor train --config C --out DIR [--epochs 3]\n"
                          "anchor trian --out DIR\n"
                          "anchor demo --out D [--profile demo|paper-small|paper-tpu] [--runs NAME,...]\n"
                          "anchor plan --config C\n    [--json] [--yaml]\n", cli) == [
        "anchor train: no option --epochs (see `anchor train --help`)",
        f"anchor trian: no such verb (verbs: {', '.join(sorted(cli))})",
        "anchor demo --profile: 'paper-tpu' is not among the values its help names",
        "anchor plan: no option --yaml (see `anchor plan --help`)",
    ]


def test_a_make_line_must_run_what_it_says() -> None:
    assert make_problems("make demo   # = anchor demo --out runs/demo, after make install") == []
    assert make_problems("make test   # the test suite (what CI runs: bash .ci/run)") == []
    assert make_problems("make demo   # = anchor demo --out runs/elsewhere") == [
        "make demo: its recipe does not run `anchor demo --out runs/elsewhere` (it runs: "
        "['anchor demo --out runs/demo'])"]
    assert make_problems("make docs   # what CI runs: bash .ci/run") == []
    assert make_problems("make paper-small   # what CI runs: bash .ci/run") == [
        "make paper-small: the comment says CI runs it, and .ci/run does not"]
    assert make_problems("make no-such-target")[0].startswith("make no-such-target: ")


def test_ran_by_needs_a_test_that_reads_the_page() -> None:
    readme = Block("README.md", 1, 1, "python", "x = 1\n",
                   directives={"ran-by": "tests/test_readme_api.py::test_readme_python_block_runs"})
    assert ran_by_problems(readme) == []
    readme.directives["ran-by"] = "tests/test_readme_api.py::test_no_such_test"
    assert ran_by_problems(readme) == ["ran-by tests/test_readme_api.py::test_no_such_test: no such test"]
    other = Block("docs/guides/multinode.md", 2, 21, "bash", "sbatch x\n",
                  directives={"ran-by": "tests/test_readme_api.py::test_readme_python_block_runs"})
    assert ran_by_problems(other) == [
        "ran-by tests/test_readme_api.py::test_readme_python_block_runs: the test's module never names "
        "docs/guides/multinode.md: it cannot read the block from it"]
    output = Block("docs/guides/multinode.md", 3, 30, "text", "anchor train: error: rank 1 on gpu-02 ...\n",
                   directives={"ran-by": "tests/train/test_multinode.py::test_a_node_that_finishes_first_is_not_taken_"
                                         "for_dead"})
    assert ran_by_problems(output) == [
        "ran-by tests/train/test_multinode.py::test_a_node_that_finishes_first_is_not_taken_for_dead: the test never "
        "compares its output with the page's (documented_output)"]
    output.directives["ran-by"] = "tests/train/test_multinode.py::test_a_dead_node_ends_the_other_within_a_minute"
    assert ran_by_problems(output) == []


def test_output_shape_keeps_all_but_hosts_rank_ranges_and_numbers() -> None:
    page = "rank 0: node 1 (ranks 8-15 on gpu-02) stopped after 31 s"
    assert output_shape("rank 0: node 1 (rank 1 on box-7.lan) stopped after 12 s", ("box-7.lan",)) == \
        output_shape(page) == "rank N: node N (rank N on HOST) stopped after N s"
    assert output_shape("rank 0: node 1 (rank 1 on box-7.lan) ended after 12 s", ("box-7.lan",)) != output_shape(page)
    assert output_shape("rank 0: node 1 (rank 1 on box-7.lan) stopped after 12 s") != output_shape(page)


def test_planted_broken_blocks_fail(tmp_path: Path) -> None:
    found = page(tmp_path, "```bash\necho one\nfalse   # a command that fails\necho three\n```\n\n"
                           "```python\nimport sys\nsys.exit(3)\n```\n\n"
                           "```python\nvalues = (1, 2)\nvalues[0] + values[1]        # 4\n```\n\n"
                           "```python\nvalues = (1, 2)\nvalues[0] + values[1]        # 3\n```\n\n"
                           "```console\n$ echo printed\nprinted\nnot printed\n```\n\n"
                           "```bash\necho made > out.txt   # → out.txt\necho said   # → runs/nothing.html\n```\n\n"
                           "<!-- recipe: refuses-on-cpu 1 \"made for one GPU\" -->\n```bash\necho fine\n```\n\n"
                           "<!-- recipe: exits 1 2 \"found\" -->\n```bash\necho fine\necho found; exit 1\n```\n\n"
                           "<!-- recipe: exits 1 1 \"found\" -->\n```bash\necho fine\n```\n\n"
                           "<!-- recipe: config train \"model.name=random:llama\" -->\n```yaml\nmodel:\n  epochs: 3\n```\n\n"
                           "<!-- recipe: config train \"model.name=random:llama\"; excerpt-of configs/train/tiny.yaml -->\n"
                           "```yaml\ndata:\n  seq_len: 256\n```\n")
    assert all(b.error is None for b in found), [b.error for b in found]
    expected = [r"'false   # a command that fails' exited 1", r"block.py' exited 3", r"the block says 4; it gives 3",
                None, r"the output shown, 'not printed', is not printed", r"wrote no runs/nothing.html",
                r"expected one line with 'made for one GPU'", None, r"expected exit 1 and 'found'",
                r"not a train config .*model.epochs", r"not an excerpt of configs/train/tiny.yaml"]
    import torch

    for block, error in zip(found, expected):
        if error is None:
            run_block(block, tmp_path / f"ok-{block.index}")
            continue
        if "refuses-on-cpu" in block.directives and torch.cuda.is_available():
            continue  # where CUDA is, the line runs instead
        with pytest.raises(AssertionError, match=error):
            run_block(block, tmp_path / f"bad-{block.index}")
