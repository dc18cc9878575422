"""anchor_core.machine names the capability torch's CPU kernels dispatch to, without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anchor_core.machine import capabilities, cpu_capability, machine
from tests import capability as cap

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
from anchor_core.machine import cpu_capability
rule = cpu_capability()
assert "torch" not in sys.modules
import torch
print(json.dumps([rule, torch.backends.cpu.get_cpu_capability(), cpu_capability()]))
"""


@pytest.mark.parametrize("capability", [*cap.params(), pytest.param(None, id="unset")])
def test_the_rule_names_what_torch_dispatches_to(capability):
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    rule, torch_says, loaded = json.loads(out.stdout)
    print(f"ATEN_CPU_CAPABILITY={capability}: rule {rule}, torch {torch_says}")
    assert rule == torch_says == loaded
    if capability is None:
        assert torch_says == capabilities()[0]  # the best this CPU can run


def test_machine_records_the_cpu():
    m = machine()
    print({k: m[k] for k in ("cpu", "cpu_capability", "cpu_capabilities", "cpu_bf16", "cpu_count", "load_average")})
    assert m["cpu_capability"] == cpu_capability() and m["cpu_capabilities"] == list(capabilities())
    assert "DEFAULT" in m["cpu_capabilities"] and isinstance(m["cpu_bf16"], list)
    assert len(m["load_average_at_start"]) == 3


_COMMIT = "import sys; sys.path.insert(0, sys.argv[1]); from anchor_core.machine import commit; print(commit())"


@pytest.mark.parametrize("given, named", [("0123456789ab", "0123456789ab"), ("0123456789ab+dirty", "0123456789ab+dirty"),
                                          ("main", "None"), ("0123456789ab; rm -rf", "None"), (None, "None")])
def test_a_tree_without_git_names_the_commit_it_was_given(tmp_path, given, named):
    """A copy of the tree without .git (what a GPU host receives) names the commit ANCHOR_COMMIT gives, only where
    it is a commit's name; the checkout itself names its own, whatever ANCHOR_COMMIT says."""
    (tmp_path / "anchor_core").mkdir()
    (tmp_path / "anchor_core" / "__init__.py").write_text("")
    (tmp_path / "anchor_core" / "machine.py").write_text(
        (ROOT / "anchor_core" / "machine.py").read_text())
    env = {k: v for k, v in os.environ.items() if k != "ANCHOR_COMMIT"}
    if given is not None:
        env["ANCHOR_COMMIT"] = given
    out = subprocess.run([sys.executable, "-c", _COMMIT, str(tmp_path)], env=env, capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert out.stdout.strip() == named
    here = subprocess.run([sys.executable, "-c", _COMMIT, str(ROOT)], env={**env, "ANCHOR_COMMIT": "0123456789ab"},
                          capture_output=True, text=True, check=True, cwd=ROOT)
    assert here.stdout.strip() != "0123456789ab" and here.stdout.strip() != "None"
