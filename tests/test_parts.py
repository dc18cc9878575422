"""anchor_core.parts: what a killed command keeps beside its output, and when it is taken again."""

from __future__ import annotations

import math

import numpy as np
import pytest

from anchor_core.errors import InputError
from anchor_core.outdir import read_marker
from anchor_core.parts import Parts, normal, parts_dir, remove_parts


def test_a_part_reads_back_as_saved_and_only_under_its_key(tmp_path):
    parts = Parts(parts_dir(tmp_path / "out"), "parity")
    assert parts.folder == tmp_path / ".out.parts" and parts.load("case-0", {"a": 1}) is None
    result = {"rel_l2": np.float32(0.25), "tol": math.inf, "ratio": math.nan, "rows": (0, 1, 96)}
    key = {"run": {"seed": 0, "grads": True}, "case": ("random:llama", 97)}
    parts.save("case-0", {"key": key, "result": normal(result)})
    assert read_marker(parts.folder)["verb"] == "parity"
    back = parts.load("case-0", key)["result"]
    assert back["rel_l2"] == 0.25 and back["tol"] == math.inf and math.isnan(back["ratio"]) and back["rows"] == [0, 1, 96]
    assert parts.load("case-0", {**key, "case": ("random:llama", 98)}) is None  # other settings: not taken
    assert parts.load("case-1", key) is None
    (parts.folder / "case-0.json").write_text('{"key": ')  # a torn file (written elsewhere: saves are atomic)
    assert parts.load("case-0", key) is None
    parts.remove()
    assert not parts.folder.exists()


def test_a_folder_of_someone_elses_files_is_refused_and_kept(tmp_path):
    folder = parts_dir(tmp_path / "out")
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="did not write"):
        Parts(folder, "eval")
    (tmp_path / ".file.parts").write_text("x")
    with pytest.raises(InputError, match="is not a folder"):
        Parts(tmp_path / ".file.parts", "eval")
    remove_parts(folder, "eval")  # as after an evaluation published without keeping parts: someone else's folder stays
    assert (folder / "notes.txt").read_text() == "mine"


def test_kept_computes_once_per_key_and_without_a_folder_leaves_the_value_as_it_is(tmp_path):
    parts, calls = Parts(parts_dir(tmp_path / "out"), "audit"), []

    def compute():
        calls.append(1)
        return {"rows": (1, 2), "tol": math.inf}

    assert parts.kept("p", {"seed": 0}, compute) == ({"rows": [1, 2], "tol": math.inf}, False)  # as it reads back
    assert parts.kept("p", {"seed": 0}, compute) == ({"rows": [1, 2], "tol": math.inf}, True) and len(calls) == 1
    assert parts.kept("p", {"seed": 1}, compute)[1] is False and len(calls) == 2  # another key: computed again
    assert Parts(None, "audit").kept("p", {"seed": 0}, compute) == ({"rows": (1, 2), "tol": math.inf}, False)


def test_saved_lists_every_part_whatever_its_key_and_refuses_what_is_not_one(tmp_path):
    """What a stopped run finished, read back without its settings (tools/merge_parity.py)."""
    parts = Parts(parts_dir(tmp_path / "out"), "parity")
    assert parts.saved() == {} and Parts(None, "parity").saved() == {}
    for i in (0, 1):
        parts.kept(f"case-{i}", {"run": {"seed": i}}, lambda i=i: {"pass": True, "i": i})
    assert parts.saved() == {f"case-{i}": {"key": {"run": {"seed": i}}, "value": {"pass": True, "i": i}}
                             for i in (0, 1)}  # the folder's marker (a dot file) is not a part
    (parts.folder / "case-2.json").write_text('{"key": {}}')
    with pytest.raises(InputError, match="case-2.json.*not a part anchor kept"):
        parts.saved()


def test_sources_id_follows_the_code_and_not_its_tests_or_caches(tmp_path, monkeypatch):
    from anchor_core.parts import sources_id

    pkg = tmp_path / "srcpkg_for_id"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "kernel.cc").write_text("int f() { return 1; }\n")
    (pkg / "model.py").write_text("X = 1\n\n\ndef f(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = sources_id(["srcpkg_for_id"])
    assert len(first) == 16 and sources_id(["srcpkg_for_id"]) == first
    for name in ("test_model.py", "conftest.py", "tests/test_x.py", "__pycache__/model.cpython-311.pyc",
                 "sub/__pycache__/k.pyc"):
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text("anything")
    assert sources_id(["srcpkg_for_id"]) == first  # tests and caches are not the code
    (pkg / "model.py").write_text('"""The model."""\n\n# a comment\nX = 1  # one\n\n\n'
                                  'def f(x):\n    """x."""\n    return x\n')
    assert sources_id(["srcpkg_for_id"]) == first  # comments and docstrings compute nothing
    (pkg / "model.py").write_text('"""The model."""\nX = 1\n\n\ndef f(x):\n    return -x\n')
    second = sources_id(["srcpkg_for_id"])
    assert second != first
    (pkg / "sub" / "kernel.cc").write_text("int f() { return 2; }\n")  # not only Python: the native kernels too
    third = sources_id(["srcpkg_for_id"])
    assert third not in (first, second)
    (pkg / "sub" / "kernel.cc").rename(pkg / "kernel.cc")  # a file moved is another code
    assert sources_id(["srcpkg_for_id"]) not in (first, second, third)
    assert sources_id(["no_such_package_here"]) != sources_id(["srcpkg_for_id"])
