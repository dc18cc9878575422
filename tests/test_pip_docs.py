"""The pages a pip user follows install what they run, and the Python API page names the whole public API.

- a code block that installs `anchor-toolkit` and, in the same block, runs something of the oracle extra (JAX:
  `jaxref`, `check_step`, the pytest fixtures, `anchor audit` or `anchor parity`) installs that extra;
- docs/guides/python-api.md names every name `import anchor` offers, every attention function it registers in
  transformers, and every fixture of the pytest plugin.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import anchor
from torchtrain.hf import FUNCTIONS

ROOT = Path(__file__).resolve().parent.parent
ORACLE_USES = re.compile(r"jaxref|check_step|anchor_parity|anchor_audit|anchor_check_step|anchor (?:audit|parity)\b")
INSTALL = re.compile(r"pip install[^\n]*?\banchor-toolkit(\[[\w,]+\])?")
ORACLE_EXTRAS = {"oracle", "demo", "all"}


def install_problems(markdown: str) -> list[str]:
    """Each fenced block that installs anchor-toolkit without the oracle extra and runs what needs it."""
    bad = []
    for block in re.findall(r"^\s*```[\w-]*\n(.*?)^\s*```", markdown, re.M | re.S):
        use = ORACLE_USES.search(block)
        for m in INSTALL.finditer(block):
            extras = set((m.group(1) or "[]")[1:-1].split(","))
            if use and not extras & ORACLE_EXTRAS:
                bad.append(f"{m.group(0)!r} then {use.group(0)!r}: needs the oracle extra")
    return bad


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_page_installs_what_it_runs():
    found = {str(p.relative_to(ROOT)): bad for p in pages() if (bad := install_problems(p.read_text(encoding="utf-8")))}
    assert found == {}


def test_an_install_without_the_oracle_is_found():
    page = ("```yaml\n- run: |\n    pip install -q anchor-toolkit -e .\n    python -m jaxref.kernels\n```\n"
            "```bash\npip install \"anchor-toolkit[oracle]\"\npython -m jaxref.kernels\n```\n"
            "```bash\npip install anchor-toolkit\nanchor train --config tiny --out r\n```\n")
    assert install_problems(page) == ["'pip install -q anchor-toolkit' then 'jaxref': needs the oracle extra"]


def fixtures() -> list[str]:
    tree = ast.parse((ROOT / "anchor" / "pytest_plugin.py").read_text(encoding="utf-8"))
    return [f.name for f in tree.body if isinstance(f, ast.FunctionDef)
            and any("fixture" in ast.unparse(d) for d in f.decorator_list)]


def test_the_python_api_page_names_the_public_api():
    page = (ROOT / "docs" / "guides" / "python-api.md").read_text(encoding="utf-8")
    names = [n for n in anchor.API] + sorted(FUNCTIONS) + fixtures()
    assert {"PackingCollator", "check_step", "anchor_varlen", "anchor_check_step"} <= set(names)
    missing = [n for n in names if not re.search(rf"`[^`]*\b{re.escape(n)}\b[^`]*`", page)]
    assert missing == [], f"docs/guides/python-api.md does not name {missing}"
