"""torchtrain's layout: its named parts (sub-folders, and any module left at its top) form at most four layers by
their imports of each other, a part importing only parts of a lower layer; no imports continued by backslash; the
modules' old paths (and the length schedule's old names) still import, with a DeprecationWarning."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchtrain"


def parts(package: Path = PACKAGE) -> dict[str, list[Path]]:
    """Each part of the package (a sub-folder, or a module at its top) and its files."""
    out: dict[str, list[Path]] = {}
    for p in sorted(package.iterdir()):
        if p.is_dir() and (p / "__init__.py").is_file():
            out[p.name] = sorted(p.rglob("*.py"))
        elif p.suffix == ".py" and p.name != "__init__.py":
            out[p.stem] = [p]
    return out


def imported_parts(files: list[Path], package: str, names: set[str]) -> set[str]:
    """The parts of `package` that `files` import, anywhere (module level or inside a function)."""
    found = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            for m in modules:
                bits = m.split(".")
                if bits[0] == package and len(bits) > 1 and bits[1] in names:
                    found.add(bits[1])
    return found


def layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each part's layer: 1 above the highest part it imports (1: it imports none). A cycle is a ValueError."""
    done: dict[str, int] = {}

    def layer(p: str, path: tuple[str, ...]) -> int:
        if p in path:
            raise ValueError(f"an import cycle: {' -> '.join(path[path.index(p):] + (p,))}")
        if p not in done:
            done[p] = 1 + max((layer(q, path + (p,)) for q in graph[p] - {p}), default=0)
        return done[p]

    for p in graph:
        layer(p, ())
    return done


def graph_of(package: Path = PACKAGE) -> dict[str, set[str]]:
    found = parts(package)
    return {name: imported_parts(files, package.name, set(found)) - {name} for name, files in found.items()}


def test_the_parts_form_at_most_four_layers_without_a_cycle():
    graph = graph_of()
    assert {"attention", "config", "hf", "model", "parallel", "training"} <= set(graph)
    got = layers(graph)
    print({p: (got[p], sorted(graph[p])) for p in sorted(got, key=got.get)})
    assert max(got.values()) <= 4, got
    assert got["training"] == max(got.values()) and not any("training" in deps for deps in graph.values())


def test_the_layering_check_finds_a_cycle_and_counts_layers(tmp_path):
    pkg = tmp_path / "pkg"
    for name, body in {"a": "", "b": "from pkg.a import x\n", "c": "import pkg.b.y\n", "d": "from pkg import c\n"}.items():
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text(body)
    (pkg / "__init__.py").write_text("")
    assert layers(graph_of(pkg)) == {"a": 1, "b": 2, "c": 3, "d": 4}
    (pkg / "a" / "__init__.py").write_text("def f():\n    from pkg.d import z\n")  # inside a function counts too
    with pytest.raises(ValueError, match="an import cycle: a -> d -> c -> b -> a"):
        layers(graph_of(pkg))


def test_each_part_says_what_it_owns_and_may_import():
    for name, files in parts().items():
        doc = ast.get_docstring(ast.parse(files[0].parent.joinpath("__init__.py").read_text())) if len(files) > 1 \
            else ast.get_docstring(ast.parse(files[0].read_text()))
        assert doc and "May import" in doc or name == "config" and doc, name


def test_no_import_is_continued_by_a_backslash():
    bad = []
    for f in sorted(PACKAGE.rglob("*.py")):
        lines = f.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            if line.lstrip().startswith(("from ", "import ")) and line.rstrip().endswith("\\"):
                bad.append(f"{f.relative_to(ROOT)}:{n}")
    assert bad == []


@pytest.mark.parametrize("old", ["torchtrain.trainer", "torchtrain.engines", "torchtrain.hf_ulysses",
                                 "torchtrain.sequence_parallel", "torchtrain.memory", "torchtrain.stages",
                                 "torchtrain.training.stages"])
def test_an_old_module_path_imports_the_moved_module_and_warns(old):
    import torchtrain

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {torchtrain.MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(torchtrain.MOVED[old])


def test_every_moved_path_imports_its_module():
    """Each entry of MOVED names a module that imports, and no old path is a file still there (which would be
    imported in place of the moved module)."""
    import torchtrain

    for old, new in torchtrain.MOVED.items():
        assert importlib.import_module(new).__name__ == new
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old


def test_the_length_schedules_old_names_are_its_new_ones_with_a_warning():
    """torchtrain.training.stages (torchtrain.training.phases as an earlier release named it): its old names import
    as the new ones, with a DeprecationWarning naming the new name; so does torchtrain.config.StageConfig."""
    from torchtrain.training import phases

    for old, new in phases.OLD_NAMES.items():
        with pytest.warns(DeprecationWarning, match=f"{old} is now torchtrain.training.phases.{new}"):
            assert getattr(phases, old) is getattr(phases, new)
    sys.modules.pop("torchtrain.training.stages", None)
    with pytest.warns(DeprecationWarning):
        from torchtrain.training.stages import StagedLoader, run_stages
    assert (StagedLoader, run_stages) == (phases.PhasedLoader, phases.run_phases)
    with pytest.warns(DeprecationWarning, match="StageConfig is now torchtrain.config.PhaseConfig"):
        from torchtrain.config import StageConfig
    from torchtrain.config import PhaseConfig
    assert StageConfig is PhaseConfig
    with pytest.raises(AttributeError):
        phases.no_such_name  # noqa: B018


def test_the_parts_names_import_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        import torchtrain.hf
        import torchtrain.model
        from torchtrain.attention import engines  # noqa: F401
    assert callable(torchtrain.hf.ulysses) and callable(torchtrain.model.set_rope)


def cfg_returns(cfg, run: Path) -> list[tuple[str, str, str]]:
    """prepare_run(cfg, run) followed through its calls: every call of a function (in the project's packages)
    that holds a TrainConfig, into a module control had already been in, made from another module than
    prepare_run's own (whose calls are its list of steps), as distinct (module, function, caller's module); the
    config's own methods are the cfg itself, not a place it goes."""
    from torchtrain.config import TrainConfig
    from torchtrain.training.run_folder import prepare_run

    roots = tuple(str(ROOT / p) + "/" for p in ("torchtrain", "anchor_core", "anchor"))
    calls: list[tuple[str, str, str]] = []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(roots):
            return
        found = frame.f_locals
        if isinstance(found.get("self"), TrainConfig) or not any(isinstance(v, TrainConfig) for v in found.values()):
            return
        back = frame.f_back
        while back is not None and not back.f_code.co_filename.startswith(roots):
            back = back.f_back  # through the standard library (contextlib's __enter__)
        name = lambda f: str(Path(f).relative_to(ROOT))  # noqa: E731
        calls.append((name(frame.f_code.co_filename), frame.f_code.co_name,
                      name(back.f_code.co_filename) if back is not None else ""))

    sys.setprofile(profile)
    try:
        prepare_run(cfg, run, progress=False)
    finally:
        sys.setprofile(None)
    root = "torchtrain/training/run_folder.py"
    seen, back_into = {root}, []
    for module, function, caller in calls[1:]:
        if module != caller and module in seen and caller != root and (module, function, caller) not in back_into:
            back_into.append((module, function, caller))
        seen.add(module)
    return back_into


@pytest.mark.parametrize("config,overrides", [("tiny", ["schedule.steps=2"]), ("tiny_phases", [])])
def test_prepare_runs_cfg_returns_to_a_module_already_left_at_most_ten_times(tmp_path, config, overrides):
    from torchtrain.config import load_train_config

    cfg = load_train_config(ROOT / "configs" / "train" / f"{config}.yaml", [*overrides, "logging.report_to=[]"])
    back_into = cfg_returns(cfg, tmp_path / "run")
    print("\n".join(f"{caller} -> {module}:{function}" for module, function, caller in back_into))
    assert len(back_into) <= 10


def test_the_training_loop_is_at_most_25_lines():
    """The body of the worker's loop over steps (torchtrain.training.trainer.worker): the step, its report
    (training/report.py), the checkpoint; no more."""
    tree = ast.parse((PACKAGE / "training" / "trainer.py").read_text(encoding="utf-8"))
    worker = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "worker")
    loops = [n for n in ast.walk(worker) if isinstance(n, ast.For) and getattr(n.target, "id", None) == "step"]
    assert len(loops) == 1
    body = loops[0].body
    lines = body[-1].end_lineno - body[0].lineno + 1
    print(f"the loop's body: {lines} lines")
    assert lines <= 25
