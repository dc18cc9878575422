"""anchor_core.machine names the capability torch's CPU kernels dispatch to, without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from anchor_core.machine import capabilities, cpu_capability, machine
from tests import capability as cap

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
