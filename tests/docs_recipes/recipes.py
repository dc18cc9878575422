"""The code blocks of README.md, docs/guides/*.md and docs/verbs/*.md, and how tests/test_docs_recipes.py runs each.

A block runs as written unless the line directly above its fence (past other HTML comments, such as a snippet
marker) declares otherwise, in an HTML comment the rendered page does not show:

    <!-- recipe: DIRECTIVE; DIRECTIVE; ... -->

Directives (arguments in double quotes where they hold spaces; `;` separates directives):

  usage                      a synopsis: every `anchor VERB` it names is a verb, every --option an option of that
                             verb (as `anchor VERB --help` lists them), and every `a|b|c` value list of an option
                             is named by the option's help; `make TARGET` lines are checked as below
  slow                       run only under `pytest -m slow` (make test-all): multi-process, long or GPU-sized
  ran-by PATH::TEST          an existing test runs this block: the test must exist and its module must read the
                             document the block is in (it names the file), not a copy; for an output block the
                             test compares its own output with the block's (documented_output, output_shape)
  sub TAG "A" => "B"         replace A (present in the block) by B before running; TAG says why, and only these
                             are allowed: hub (A is a model hub id), gpu (a value sized for a GPU: a process
                             count, a config, a model, its data), cluster (a host, service or shared path of
                             a cluster), elided (A is the `...` of a fragment; B is the least that runs).
                             B may hold {tiny_hf} (a tiny random Llama folder with its tokenizer), {port}
                             (a free port), {scratch} (the block's folder) and {paper_on_cpu} (PAPER_ON_CPU)
  prelude FILE               Python run before the block in the same script (defines the names a fragment uses)
  setup FILE                 before the block: FILE (.py) runs once in the block's folder, or FILE (a folder) is
                             copied into it
  pytest                     the Python block is a test module: pytest runs it and every test in it must pass
  torchrun N                 the Python block runs under `torchrun --nproc_per_node N`
  nodes N                    the (one-command) bash block is started N times at once: one launcher per node
  stand-ins FOLDER           the executables in FOLDER come first on PATH (a cluster's commands, stood in for)
  extra fp8                  the block needs the `fp8` extra (torchao): the checkout's .cache/fp8, where make install
                             puts it beside the venv, goes on PYTHONPATH
  config train "K=V" ...     a YAML block: loaded by torchtrain.config.load_train_config with these overrides
                             added (the least that makes the excerpt a config)
  excerpt-of FILE            a YAML block: every key and value it holds is FILE's
  refuses-on-cpu N,M "TEXT"  where torch sees no CUDA device, command lines N, M (1-based) exit 2 with one line
                             `anchor VERB: error: ...TEXT...` and nothing else on stderr
  exits CODE N,M "TEXT"      command lines N, M exit CODE (a verdict the page describes, such as a parity
                             finding: exit 1) and their output holds TEXT

How blocks run:

  bash      each command line (continuation lines joined) under `bash -euo pipefail`, one after the other (each
            must exit 0 unless declared otherwise), in a
            scratch folder holding symlinks to the checkout's configs/, examples/, .venv/, .cache/ and Makefile,
            with the venv first on PATH, ANCHOR_CACHE set, one intra-op thread (the tests share the cores), and
            PET_MASTER_PORT set to a free port (torchrun's default 29500 would meet other tests' worlds). A line
            `make TARGET`: `make -n` must know the target and print what the line's comment says it runs
            (`# = COMMAND`), a comment naming .ci/run needs .ci/run to run it; it then runs with its
            `install` prerequisite taken as done (the test's own environment is that install), except a
            target that runs pytest: this suite is what it runs (CI runs it: .ci/run). A comment
            `→ PATH` says what the line writes: PATH must exist after it.
  console   the `$ ` lines run as bash lines; every other line is output that must appear in theirs.
  python    the block as a script (after its prelude) in its own process; where the block ends with an
            expression whose comment is a Python literal (`x, y  # "computes", "anchor"`), the value must equal it.
  yaml      checked as a config (`config`, `excerpt-of`); a YAML block without them is an error.
  text      a fence without a language is output: the test that produces and checks it is named (`ran-by`).
"""

from __future__ import annotations

import ast
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests import fp8

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/guides/*.md", "docs/verbs/*.md")
FENCE = re.compile(r"^```([\w-]*)\s*$")
DECLARATION = re.compile(r"^<!--\s*recipe:(.*?)-->\s*$")
HTML_COMMENT = re.compile(r"^<!--.*-->\s*$")
SUB_TAGS = ("hub", "gpu", "cluster", "elided")
HUB_ID = re.compile(r'^(["\']?)[A-Za-z0-9][\w.-]*/[\w.-]+\1$')
LINKED = ("configs", "examples", ".venv", ".cache", "Makefile")
# The paper's run (Llama-2-7B, 64K windows, 8 GPUs, flash_varlen) at a CPU's size, everything else as configured
# (bf16, ZeRO-3, Ulysses sequence parallelism, tiled MLP, activation checkpointing): a tiny random Llama, the
# embedded corpus, 256-slot windows over 2 processes, 2 steps.
PAPER_ON_CPU = ("model.name=random:llama model.engine=varlen data.path=corpus data.seq_len=256 data.pack.budget=20000 "
                "parallel.sequence_parallel=2 schedule.steps=2 eval.every=1 eval.window=2 eval.heldout_windows=2")
RUN_TIMEOUT = 3 * 3600


class DeclarationError(ValueError):
    """A declaration the collector does not accept: an unknown directive, a bad argument, a misplaced comment."""


@dataclass
class Block:
    page: str  # path relative to the checkout
    index: int  # 1-based among the page's blocks
    line: int  # the opening fence's line, 1-based
    lang: str
    text: str
    declaration: str | None = None
    directives: dict = field(default_factory=dict)
    error: str | None = None  # what is wrong with the declaration, where it does not parse or fit the block

    @property
    def id(self) -> str:
        return f"{self.page}:{self.index}"

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def pages(root: Path = ROOT) -> list[Path]:
    found: list[Path] = []
    for pattern in PAGES:
        found += sorted(Path(p) for p in glob.glob(str(root / pattern)))
    return found


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """Every fenced block of the Markdown file `path` (one without a language is `text`: output), with its
    declaration parsed (a declaration that does not parse or fit the block is the block's `error`)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    name = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
    found: list[Block] = []
    for i, j, decl_line in _fences(lines):
        lang = FENCE.match(lines[i]).group(1) or "text"
        block = Block(name, len(found) + 1, i + 1, lang, "\n".join(lines[i + 1:j]) + "\n")
        try:
            if decl_line is not None:
                block.declaration = DECLARATION.match(lines[decl_line]).group(1).strip()
                block.directives = parse_declaration(block.declaration)
            check_kind(block)
        except DeclarationError as e:
            block.error = f"{block.where}: {e}"
        found.append(block)
    return found


def _fences(lines: list[str]) -> list[tuple[int, int, int | None]]:
    """(opening fence, closing fence, declaration line or None) of each block, 0-based."""
    out = []
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            decl = None
            k = i - 1
            while k >= 0 and HTML_COMMENT.match(lines[k]):
                if DECLARATION.match(lines[k]):
                    decl = k
                    break
                k -= 1
            out.append((i, j, decl))
            i = j
        i += 1
    return out


def stray_declarations(path: Path) -> list[int]:
    """1-based lines of recipe declarations that stand above no code block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    claimed = {d for _, _, d in _fences(lines)}
    return [n + 1 for n, text in enumerate(lines) if DECLARATION.match(text) and n not in claimed]


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for p in pages(root) for b in blocks(p, root)]


def _tokens(text: str) -> list[list[str]]:
    """The declaration split into directives, each a list of words (quotes removed)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";")
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        words = list(lexer)
    except ValueError as e:
        raise DeclarationError(f"the declaration does not parse ({e})") from None
    out: list[list[str]] = [[]]
    for w in words:
        if w == ";":
            out.append([])
        else:
            out[-1].append(w)
    return [d for d in out if d]


def parse_declaration(text: str) -> dict:
    """{directive: arguments} of a declaration; DeclarationError for anything unknown or malformed."""
    out: dict = {}
    seen: set[str] = set()
    for words in _tokens(text):
        kind, args = words[0], words[1:]
        if kind in seen and kind not in ("sub", "refuses-on-cpu", "exits"):
            raise DeclarationError(f"`{kind}` is given twice")
        seen.add(kind)

        def need(n: int) -> None:
            if len(args) != n:
                raise DeclarationError(f"`{kind}` takes {n} argument(s), got {len(args)}: {' '.join(words)!r}")

        if kind in ("usage", "slow", "pytest"):
            need(0)
            out[kind] = True
        elif kind == "ran-by":
            need(1)
            if "::" not in args[0]:
                raise DeclarationError(f"ran-by takes PATH::TEST, got {args[0]!r}")
            out[kind] = args[0]
        elif kind == "sub":
            if len(args) != 4 or args[2] != "=>":
                raise DeclarationError(f'sub takes TAG "A" => "B", got {" ".join(words)!r}')
            tag, a, _, b = args
            if tag not in SUB_TAGS:
                raise DeclarationError(f"sub: unknown reason {tag!r} (allowed: {', '.join(SUB_TAGS)})")
            if tag == "hub" and not HUB_ID.match(a):
                raise DeclarationError(f"sub hub: {a!r} is not a model hub id")
            if tag == "elided" and "..." not in a:
                raise DeclarationError(f"sub elided: {a!r} holds no `...`")
            out.setdefault("sub", []).append((tag, a, b))
        elif kind in ("prelude", "setup", "excerpt-of", "stand-ins"):
            need(1)
            if not (ROOT / args[0]).exists():
                raise DeclarationError(f"{kind}: no such file {args[0]}")
            out[kind] = args[0]
        elif kind == "extra":
            need(1)
            if args[0] != "fp8":
                raise DeclarationError(f"extra: only fp8 is installed beside the venv, got {args[0]!r}")
            out[kind] = args[0]
        elif kind in ("torchrun", "nodes"):
            need(1)
            if not args[0].isdigit() or int(args[0]) < 1:
                raise DeclarationError(f"{kind} takes a process count, got {args[0]!r}")
            out[kind] = int(args[0])
        elif kind == "config":
            if not args or args[0] != "train":
                raise DeclarationError("config takes `train` and then the overrides it adds")
            out[kind] = args[1:]
        elif kind == "exits":
            need(3)
            if not args[0].isdigit() or int(args[0]) == 0 or not re.fullmatch(r"\d+(,\d+)*", args[1]):
                raise DeclarationError(f'exits takes CODE LINES "TEXT" (exits 1 2 "..."), got {" ".join(args)!r}')
            out.setdefault(kind, []).append((int(args[0]), [int(n) for n in args[1].split(",")], args[2]))
        elif kind == "refuses-on-cpu":
            need(2)
            if not re.fullmatch(r"\d+(,\d+)*", args[0]):
                raise DeclarationError(f"refuses-on-cpu takes line numbers (1,3), got {args[0]!r}")
            out.setdefault(kind, []).append(([int(n) for n in args[0].split(",")], args[1]))
        else:
            raise DeclarationError(f"unknown recipe directive {kind!r}")
    return out


def check_kind(block: Block) -> None:
    """Directives that cannot go together, or that do not fit the block's language."""
    d = block.directives
    if block.lang not in ("bash", "python", "console", "yaml", "text"):
        raise DeclarationError(f"a ```{block.lang} block: no runner for that language")
    if block.lang == "text" and "ran-by" not in d:
        raise DeclarationError("a block of output (no language) needs `ran-by` the test that holds that output")
    if block.lang == "yaml" and "config" not in d and "ran-by" not in d:
        raise DeclarationError("a YAML block needs `config train` (it is checked as a config)")
    if block.lang != "yaml" and ("config" in d or "excerpt-of" in d):
        raise DeclarationError("config and excerpt-of are for YAML blocks")
    if block.lang != "python" and ({"pytest", "torchrun", "prelude"} & set(d)):
        raise DeclarationError("pytest, torchrun and prelude are for Python blocks")
    if "usage" in d and set(d) - {"usage"}:
        raise DeclarationError("a usage block is only checked: it takes no other directive")
    if "ran-by" in d and set(d) - {"ran-by"}:
        raise DeclarationError("a block another test runs takes no other directive here")
    for _, a, _ in d.get("sub", []):
        if a not in block.text:
            raise DeclarationError(f"sub: {a!r} is not in the block")


# ---------------------------------------------------------------------------------------------------------------
# lines


def command_lines(text: str, *, indented_continues: bool = False) -> list[str]:
    """The block's commands: comment-only and blank lines dropped, `\\` continuations joined (and, in a synopsis,
    an indented line continues the one before)."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if indented_continues and not pending and raw[:1].isspace() and out:
            out[-1] += " " + line.strip()
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        out.append((pending + line.strip()) if pending else line.strip())
        pending = ""
    if pending:
        out.append(pending.strip())
    return out


def split_comment(line: str) -> tuple[str, str]:
    """(command, trailing comment) of a bash line: the comment starts at a `#` outside quotes after a space."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line, ""


# ---------------------------------------------------------------------------------------------------------------
# usage: the synopsis against the CLI


def cli_options() -> dict[str, dict[str, object]]:
    """{verb: {option: click parameter}} as `anchor VERB --help` lists them."""
    import typer.main

    from anchor.cli import app, load_commands

    load_commands()
    group = typer.main.get_command(app)
    out: dict[str, dict[str, object]] = {}
    for verb, command in group.commands.items():
        opts: dict[str, object] = {}
        for p in command.params:
            if getattr(p, "hidden", False):
                continue
            for o in [*p.opts, *getattr(p, "secondary_opts", [])]:
                if o.startswith("-"):
                    opts[o] = p
        opts.setdefault("--help", None)
        out[verb] = opts
    return out


METAVAR = re.compile(r"^[A-Z][A-Z0-9_.,]*$|\.\.\.|…")


def usage_problems(text: str, cli: dict[str, dict[str, object]]) -> list[str]:
    """What a synopsis names that the CLI lacks: a verb, an option of the verb, a listed value of an option."""
    bad: list[str] = []
    for line in command_lines(text, indented_continues=True):
        command, _ = split_comment(line)
        if command.startswith("make "):
            bad += make_problems(line)
            continue
        m = re.search(r"(?:^|\s)anchor\s+([\w-]+)", command)
        if not m:
            bad.append(f"{command!r}: no `anchor VERB` in this synopsis line")
            continue
        verb = m.group(1)
        if verb not in cli:
            bad.append(f"anchor {verb}: no such verb (verbs: {', '.join(sorted(cli))})")
            continue
        words = command[m.end():].replace("[", " ").replace("]", " ").split()
        for i, word in enumerate(words):
            if not word.startswith("--"):
                continue
            opt = word.split("=")[0]
            if opt not in cli[verb]:
                bad.append(f"anchor {verb}: no option {opt} (see `anchor {verb} --help`)")
                continue
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else ""
            if "|" in value:
                param = cli[verb][opt]
                said = f"{getattr(param, 'help', '') or ''} {' '.join(map(str, getattr(getattr(param, 'type', None), 'choices', None) or []))}"
                for alt in value.split("|"):
                    if alt and not METAVAR.search(alt) and not re.search(rf"(?<![\w-]){re.escape(alt)}(?![\w-])", said):
                        bad.append(f"anchor {verb} {opt}: {alt!r} is not among the values its help names")
    return bad


# ---------------------------------------------------------------------------------------------------------------
# make lines


def _make(args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def make_target(line: str) -> tuple[str, str]:
    command, comment = split_comment(line)
    words = command.split()
    if len(words) != 2 or words[0] != "make":
        raise DeclarationError(f"{command!r}: a make line names one target")
    return words[1], comment


def make_problems(line: str, root: Path = ROOT) -> list[str]:
    """`make TARGET  # = COMMAND ... .ci/run`: the target exists, its own recipe (install taken as done) prints
    COMMAND, and .ci/run runs it where the comment says CI does."""
    target, comment = make_target(line)
    done = _make(["-n", "-o", "install", target], root)
    if done.returncode != 0:
        return [f"make {target}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'fails'}"]
    printed = [re.sub(r"(^|\s)\.venv/bin/", r"\1", ln.strip()) for ln in done.stdout.splitlines()]
    bad = []
    said = re.match(r"=\s*(.+?)(?:,|$)", comment)
    if said and not any(ln == said.group(1).strip() or ln.endswith(" " + said.group(1).strip()) for ln in printed):
        bad.append(f"make {target}: its recipe does not run `{said.group(1).strip()}` (it runs: {printed})")
    if ".ci/run" in comment:
        ci = (root / ".ci" / "run").read_text()
        if not re.search(rf"^\s*make {re.escape(target)}\s*$", ci, re.M):
            bad.append(f"make {target}: the comment says CI runs it, and .ci/run does not")
    return bad


def runs_pytest(target: str, root: Path = ROOT) -> bool:
    done = _make(["-n", "-o", "install", target], root)
    return bool(re.search(r"-m pytest\b|\bpytest\b", done.stdout))


# ---------------------------------------------------------------------------------------------------------------
# ran-by


def ran_by_problems(block: Block, root: Path = ROOT) -> list[str]:
    node = block.directives["ran-by"]
    file, _, name = node.partition("::")
    path = root / file
    if not path.is_file():
        return [f"ran-by {node}: no such test file"]
    source = path.read_text(encoding="utf-8")
    names = {f.name for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef)}
    bad = []
    if name not in names or not name.startswith("test"):
        bad.append(f"ran-by {node}: no such test")
    page = Path(block.page)
    reads = page.name in source or f'"{page.stem}"' in source or page.as_posix() in source
    if not reads:
        bad.append(f"ran-by {node}: the test's module never names {block.page}: it cannot read the block from it")
    if block.lang == "text" and name in names:
        test = next(f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef) and f.name == name)
        if "documented_output" not in (ast.get_source_segment(source, test) or ""):
            bad.append(f"ran-by {node}: the test never compares its output with the page's (documented_output)")
    return bad


def documented_output(node: str, root: Path = ROOT) -> str:
    """The text of the output block declared `ran-by NODE` (`PATH::TEST`): what the page shows that test's run
    printing."""
    found = [b for b in all_blocks(root) if b.lang == "text" and b.directives.get("ran-by") == node]
    if len(found) != 1:
        raise LookupError(f"{len(found)} output blocks are declared ran-by {node}")
    return found[0].text.strip()


HOST_WORD = re.compile(r"\bgpu-\d+\b")


def output_shape(text: str, hosts: tuple[str, ...] = ()) -> str:
    """A line of output with what differs between a cluster and a test's machine made one token: each host name
    (`gpu-NN` on the pages, `hosts` here) HOST, a rank range `ranks A-B` `rank N`, and every number N. A page's
    line and a test's line have one shape exactly when they differ only in those."""
    for host in sorted(hosts, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", "HOST", text)
    text = HOST_WORD.sub("HOST", text)
    text = re.sub(r"\branks \d+-\d+", "rank 0", text)
    return re.sub(r"\d+(?:\.\d+)?(?:e-?\d+)?", "N", text)


# ---------------------------------------------------------------------------------------------------------------
# yaml


def is_excerpt(part: object, whole: object) -> bool:
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and is_excerpt(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and len(part) == len(whole) and all(map(is_excerpt, part, whole))
    return part == whole


def config_problems(block: Block, scratch: Path) -> list[str]:
    import yaml

    from torchtrain.config import load_train_config

    bad = []
    d = block.directives
    data = yaml.safe_load(block.text)
    if "excerpt-of" in d:
        whole = yaml.safe_load((ROOT / d["excerpt-of"]).read_text())
        if not is_excerpt(data, whole):
            bad.append(f"{block.where}: the block is not an excerpt of {d['excerpt-of']}: a key or value differs")
    file = scratch / "block.yaml"
    file.write_text(block.text)
    try:
        load_train_config(file, list(d["config"]))
    except Exception as e:  # the loader's one-line InputError, or anything else it raises
        bad.append(f"{block.where}: not a train config with {d['config']}: {e}")
    return bad


# ---------------------------------------------------------------------------------------------------------------
# running


@dataclass
class Scratch:
    folder: Path
    port: int
    env: dict


_SHARED: dict[str, Path] = {}
# A folder that stands for every block's `runs/` when set, kept between pytest runs: the blocks that take hours on a
# CPU (README's paper-small line) resume their finished jobs and their training where a killed pytest left them,
# as the demo does in a user's checkout.
KEEP_RUNS = "ANCHOR_RECIPES_RUNS"


def shared_demo() -> Path:
    """The `runs/demo` every block of this process sees: a page's second `make demo` reuses the first's finished
    jobs, as it does in a user's checkout (the demo's runs take minutes each)."""
    if "demo" not in _SHARED:
        import atexit
        import tempfile

        _SHARED["demo"] = Path(tempfile.mkdtemp(prefix="recipes-demo-"))
        atexit.register(shutil.rmtree, _SHARED["demo"], True)  # its checkpoints are gigabytes
    return _SHARED["demo"]


def make_scratch(folder: Path, block: Block) -> Scratch:
    from torchtrain.parallel.distributed import environ_for_child, free_port

    folder.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        if not (folder / name).exists() and (ROOT / name).exists():
            os.symlink(ROOT / name, folder / name)
    kept = os.environ.get(KEEP_RUNS)
    if kept and not (folder / "runs").exists():  # every block's runs/ outlives this pytest: a killed demo resumes
        Path(kept).mkdir(parents=True, exist_ok=True)
        os.symlink(Path(kept).resolve(), folder / "runs")
    if not kept and not (folder / "runs" / "demo").exists():  # one runs/demo for the session, as in a checkout
        (folder / "runs").mkdir(exist_ok=True)
        os.symlink(shared_demo(), folder / "runs" / "demo")
    path = [str(ROOT / ".venv" / "bin")]
    if "stand-ins" in block.directives:
        path.insert(0, str(ROOT / block.directives["stand-ins"]))
    env = environ_for_child()
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    env.update({"PATH": os.pathsep.join([*path, env.get("PATH", "")]), "ANCHOR_CACHE": str(ROOT / ".cache"),
                "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"})
    if block.directives.get("extra") == "fp8":
        env = fp8.env(env)
    return Scratch(folder, free_port(), env)


def tiny_hf(folder: Path) -> Path:
    """A tiny random Llama in Hugging Face's layout with its tokenizer (what a hub id stands for here)."""
    out = folder / "tiny-hf"
    if not out.exists():
        from anchor_core.export import export_hf
        from anchor_core.spec import random_preset
        from anchor_core.weights import random_state

        spec = random_preset("llama")
        export_hf(spec, random_state(spec, seed=0), out, tokenizer_of="random:llama")
    return out


def substituted(block: Block, scratch: Scratch) -> str:
    text = block.text
    for _, a, b in block.directives.get("sub", []):
        values = {"port": str(scratch.port), "scratch": str(scratch.folder), "paper_on_cpu": PAPER_ON_CPU}
        if "{tiny_hf}" in b:
            values["tiny_hf"] = str(tiny_hf(scratch.folder))
        text = text.replace(a, b.format(**values))
    return text


def setup(block: Block, scratch: Scratch) -> None:
    what = block.directives.get("setup")
    if not what:
        return
    src = ROOT / what
    if src.is_dir():
        shutil.copytree(src, scratch.folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        done = subprocess.run([sys.executable, str(src)], cwd=scratch.folder, env=scratch.env, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT)
        assert done.returncode == 0, f"{block.where}: setup {what} failed:\n{done.stderr[-3000:]}"


def cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _report(block: Block, what: str, done: subprocess.CompletedProcess) -> str:
    return (f"{block.where}: {what!r} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}"
            f"\n--- stderr\n{done.stderr[-5000:]}")


def run_bash(block: Block, scratch: Scratch) -> list[str]:
    """Every command line of a bash (or console) block; the outputs, in order."""
    text = substituted(block, scratch)
    if block.lang == "console":
        shown = [ln for ln in text.splitlines() if ln.strip()]
        lines = [ln[2:] for ln in shown if ln.startswith("$ ")]
        expected = [ln for ln in shown if not ln.startswith("$ ")]
    else:
        lines, expected = command_lines(text), []
    refusals = {n: needle for ns, needle in block.directives.get("refuses-on-cpu", []) for n in ns}
    verdicts = {n: (code, needle) for code, ns, needle in block.directives.get("exits", []) for n in ns}
    for n in [*refusals, *verdicts]:
        assert 1 <= n <= len(lines), f"{block.where}: the declaration names line {n}; the block has {len(lines)}"
    outputs: list[str] = []
    for n, line in enumerate(lines, 1):
        made = re.search(r"→\s*([\w./-]+)", split_comment(line)[1])  # `# ... → runs/demo/index.html`: it writes that
        if line.startswith("make "):
            outputs.append(run_make(block, line, scratch))
            if made and not runs_pytest(make_target(line)[0]):
                assert (scratch.folder / made.group(1)).exists(), f"{block.where}: {line!r} wrote no {made.group(1)}"
            continue
        results = run_copies(line, block.directives.get("nodes", 1), scratch, f"line{n}")
        for done in results:
            if n in refusals and not cuda_here():
                said = [ln for ln in done.stderr.splitlines() if ln.strip()]
                assert done.returncode == 2 and len(said) == 1 and re.match(r"anchor [\w-]+: error: ", said[0]) \
                    and refusals[n] in said[0], _report(block, line, done) + f"\n(expected one line with {refusals[n]!r})"
            elif n in verdicts:
                code, needle = verdicts[n]
                assert done.returncode == code and needle in done.stdout + done.stderr, \
                    _report(block, line, done) + f"\n(expected exit {code} and {needle!r})"
            else:
                assert done.returncode == 0, _report(block, line, done)
                if made:
                    assert (scratch.folder / made.group(1)).exists(), f"{block.where}: {line!r} wrote no {made.group(1)}"
        outputs.append(results[0].stdout)
    for want in expected:
        assert any(want.strip() in out for out in outputs), f"{block.where}: the output shown, {want!r}, is not printed"
    return outputs


def run_copies(line: str, copies: int, scratch: Scratch, name: str) -> list[subprocess.CompletedProcess]:
    """`line` under bash, `copies` times at once (each a launcher of one node), to its end. Their output goes to
    files: a pipe read after another process's would fill and stop a rank the others wait for in a collective."""
    logs = scratch.folder / ".recipe-logs"
    logs.mkdir(exist_ok=True)
    procs = []
    for k in range(copies):
        with open(logs / f"{name}-{k}.out", "w") as out, open(logs / f"{name}-{k}.err", "w") as err:
            procs.append(subprocess.Popen(["bash", "-euo", "pipefail", "-c", line], cwd=scratch.folder, env=scratch.env,
                                          stdout=out, stderr=err, start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=RUN_TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # the line's whole process group: torchrun and its ranks
                p.wait()
    return [subprocess.CompletedProcess(line, p.returncode, (logs / f"{name}-{k}.out").read_text(errors="replace"),
                                        (logs / f"{name}-{k}.err").read_text(errors="replace"))
            for k, p in enumerate(procs)]


def run_make(block: Block, line: str, scratch: Scratch) -> str:
    target, _ = make_target(line)
    bad = make_problems(line)
    assert not bad, f"{block.where}: {bad}"
    if runs_pytest(target):
        return ""  # this suite is what it runs; .ci/run runs it (make_problems checked that where it is said)
    done = _make(["-o", "install", target], scratch.folder, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, _report(block, line, done)
    return done.stdout


def expected_value(source: str) -> tuple[str, object] | None:
    """(the script with its last expression kept as `_recipe_value`, the literal its comment gives), or None."""
    tree = ast.parse(source)
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return None
    last = tree.body[-1]
    lines = source.splitlines()
    _, comment = split_comment(lines[last.end_lineno - 1])
    if not comment:
        return None
    try:
        value = ast.literal_eval(comment.split(";")[0].strip())
    except (ValueError, SyntaxError):
        return None
    expr = ast.get_source_segment(source, last)
    head = "\n".join(lines[:last.lineno - 1])
    return f"{head}\n_recipe_value = ({expr})\n", value


def run_python(block: Block, scratch: Scratch) -> subprocess.CompletedProcess:
    d = block.directives
    text = substituted(block, scratch)
    prelude = (ROOT / d["prelude"]).read_text() + "\n" if "prelude" in d else ""
    check = expected_value(text)
    if check:
        text, value = check
        said = f"{block.where}: the block says {value!r}; it gives "
        text += f"assert _recipe_value == {value!r}, {said!r} + repr(_recipe_value)\n"
    name = "test_block.py" if "pytest" in d else "block.py"
    (scratch.folder / name).write_text(prelude + text)
    if "pytest" in d:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", name]
    elif "torchrun" in d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(d["torchrun"]), name]
    else:
        cmd = [sys.executable, name]
    done = subprocess.run(cmd, cwd=scratch.folder, env=scratch.env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    assert done.returncode == 0, _report(block, " ".join(cmd), done)
    if "pytest" in d:
        assert re.search(r"\b\d+ passed\b", done.stdout) and not re.search(r"\b(skipped|xfailed|deselected)\b",
                                                                          done.stdout.splitlines()[-1]), \
            _report(block, " ".join(cmd), done)
    return done


def run_block(block: Block, folder: Path) -> None:
    """Check or run one block as its declaration says (AssertionError with the reason when it fails)."""
    d = block.directives
    if "ran-by" in d:
        bad = ran_by_problems(block)
        assert not bad, f"{block.where}: {bad}"
        return
    if "usage" in d:
        bad = usage_problems(block.text, cli_options())
        assert not bad, f"{block.where}: {bad}"
        return
    scratch = make_scratch(folder, block)
    if block.lang == "yaml":
        bad = config_problems(block, scratch.folder)
        assert not bad, "\n".join(bad)
        return
    setup(block, scratch)
    if block.lang == "python":
        run_python(block, scratch)
    else:
        run_bash(block, scratch)
