"""tools/gpu_kit.py, the real weights' way to the GPU machine, dry-run here: the GGUF split into parts, the
parts arriving one device call at a time, joined only when whole and equal by sha256; a damaged part or a
wrong join is refused and leaves no file under the target's name."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "tools" / "gpu_kit.py"


def kit(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(KIT), *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_parts_arrive_one_call_at_a_time_and_join_to_the_same_sha256(tmp_path):
    from anchor_core.paths import resolve_model_name

    src = Path(resolve_model_name("default"))  # the real SmolLM2 GGUF (98 MB)
    here = tmp_path / "here"
    assert kit("split", src, "--out", here, "--part-mib", 30).returncode == 0
    manifest = json.loads((here / "manifest.json").read_text())
    assert len(manifest["parts"]) == -(-src.stat().st_size // (30 * 2**20))
    assert all(p["bytes"] <= 30 * 2**20 for p in manifest["parts"])
    stash, into = tmp_path / "stash", tmp_path / "models"
    for k, part in enumerate(manifest["parts"]):  # each call carries the manifest and one part
        call = tmp_path / f"call-{k}"
        call.mkdir()
        shutil.copy(here / "manifest.json", call)
        shutil.copy(here / part["file"], call)
        p = kit("join", call, "--stash", stash, "--into", into)
        assert p.returncode == 0, p.stderr
        last = k == len(manifest["parts"]) - 1
        assert ("complete" in p.stdout) == last and (into / src.name).exists() == last, p.stdout
    digest = hashlib.sha256((into / src.name).read_bytes()).hexdigest()
    assert digest == manifest["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


def test_a_damaged_part_is_refused(tmp_path):
    src = tmp_path / "w.bin"
    src.write_bytes(bytes(range(256)) * 9001)
    here = tmp_path / "here"
    assert kit("split", src, "--out", here, "--part-mib", 0.5).returncode == 0
    part = sorted(here.glob("w.bin.part-*"))[1]
    data = bytearray(part.read_bytes())
    data[7] ^= 1
    part.write_bytes(bytes(data))
    p = kit("join", here, "--stash", tmp_path / "stash", "--into", tmp_path / "models")
    print(p.stdout, p.stderr)
    assert p.returncode == 2 and "sha256 differs" in p.stderr and not (tmp_path / "models" / "w.bin").exists()


def _kit_module():
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_kit

    return gpu_kit


def _git_tree(root: Path, tree_bytes: int) -> None:
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    (root / ".gitignore").write_text("/.whl/\n/.devkit/\n")
    (root / "code.bin").write_bytes(b"x" * tree_bytes)  # tracked or not, it travels unless ignored
    (root / "ignored").mkdir()


def _sized(path: Path, mib: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * int(mib * 2**20))


def test_the_kits_calls_are_measured_with_the_tree_and_one_over_a_transfer_is_named(tmp_path):
    from anchor_core.errors import InputError

    gk = _kit_module()
    root = tmp_path / "repo"
    _git_tree(root, 3 * 2**20)
    _sized(root / ".whl" / "a-1-py3-none-any.whl", 9.5)
    _sized(root / ".devkit" / "parts" / "w.part-000", 48)
    _sized(root / ".devkit" / "parts" / "w.part-001", 40)
    (root / ".devkit" / "parts" / "manifest.json").write_text("{}")
    _sized(root / ".devkit" / "attn_grad_inputs.npz", 10)
    _sized(root / ".devkit" / "heldout.jsonl", 6)
    assert abs(gk.travelling_tree_bytes(root) / 2**20 - 3) < 0.01  # .whl, .devkit ignored: they go as carry
    plan = gk.carry_plan(root, ["w.part-000", "w.part-001"])
    mib = {call.split(":")[0]: c["mib_with_tree"] for call, c in plan["calls"].items()}
    assert mib == {"1": 12.5, "2": 51.0, "3 (parity)": 43.0, "3 (paper-gpu)": 49.0}
    for c in plan["calls"].values():  # every carried path exists (the device tool drops a missing one)
        assert all((root / p).exists() for p in c["carry"]) and len(c["carry"]) <= 8
    _sized(root / ".devkit" / "parts" / "w.part-000", 61.5)  # 64.5 MiB: over the transfer
    with pytest.raises(InputError, match=r"call 2: .* 64.5 MiB .*--part-mib"):
        gk.carry_plan(root, ["w.part-000", "w.part-001"])
    # a larger copy size (kit --transfer-mib) takes it; a smaller one refuses what the default took
    assert gk.carry_plan(root, ["w.part-000", "w.part-001"], transfer_mib=65)["calls"]["2: weights part 1"][
        "mib_with_tree"] == 64.5
    with pytest.raises(InputError, match=r"call 1: .* 12.5 MiB .*over the 12 MiB"):
        gk.carry_plan(root, ["w.part-000", "w.part-001"], transfer_mib=12)
    _sized(root / ".devkit" / "parts" / "w.part-000", 48)
    _sized(root / ".whl" / "b-1-py3-none-any.whl", 52)  # the wheels' call over it
    with pytest.raises(InputError, match=r"call 1: .* 64.5 MiB .*fewer wheels"):
        gk.carry_plan(root, ["w.part-000", "w.part-001"])


def test_the_kits_calls_are_those_gpu_parity_sh_plans():
    gk = _kit_module()
    plan = (ROOT / "tools" / "gpu_parity.sh").read_text()
    for call, items in gk.CALLS.items():  # the header's calls carry the same files
        for item in items:
            name = Path(item).name.replace("{part0}", "part-000").replace("{part1}", "part-001")
            assert name in plan or name == "manifest.json" and "manifest" in plan, (call, name)
    assert "gpu_kit.py kit" in plan and "make gpu-kit" in (ROOT / "README.md").read_text()


def test_the_held_out_documents_are_jsonl_that_anchor_reads(tmp_path):
    from anchor_core.data.readers import iter_documents
    from anchor.eval.perplexity import heldout_files

    gk = _kit_module()
    out = tmp_path / ".devkit" / "heldout.jsonl"  # a fresh checkout has no .devkit yet
    n = gk.kit_heldout(out, min_bytes=50_000)
    texts = [d.text for d in iter_documents(out)]
    big = [p for p in heldout_files() if p.stat().st_size > 50_000]
    assert n == len(texts) == len(big) > 0
    assert texts[0] == big[0].read_text(errors="replace")


def test_a_first_part_of_its_own_size_and_the_rest_after_it(tmp_path):
    gk = _kit_module()
    src = tmp_path / "w.bin"
    src.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    m = gk.split(src, tmp_path / "parts", 0.6, first_mib=0.25)
    assert [p["bytes"] for p in m["parts"]] == [2**18, int(0.6 * 2**20), 2**20 - 2**18 - int(0.6 * 2**20)]
    m = gk.split(src, tmp_path / "parts", 0.75, first_mib=0.25)  # a split again: no part of the last one left
    assert [p["bytes"] for p in m["parts"]] == [2**18, 3 * 2**18]
    assert sorted(f.name for f in (tmp_path / "parts").glob("w.bin.part-*")) == ["w.bin.part-000", "w.bin.part-001"]
    p = kit("join", tmp_path / "parts", "--stash", tmp_path / "stash", "--into", tmp_path / "models")
    assert p.returncode == 0 and (tmp_path / "models" / "w.bin").read_bytes() == src.read_bytes()


def test_keep_adds_a_sessions_parity_parts_to_its_gpus_archive(tmp_path):
    """`gpu_kit.py keep R`: R's `.<run>.parts` folders (anchor's marker) into parts_<gpu>.tgz, a part of the
    same path replaced, the others kept; the same input gives the same bytes; no parts or no GPU: refused."""
    import tarfile

    from anchor_core.errors import InputError
    from anchor_core.parts import Parts

    gk = _kit_module()
    res, into = tmp_path / "res", tmp_path / "results"
    res.mkdir()
    (res / "weights.txt").write_text("b179c952  model.gguf\nNVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n")
    with pytest.raises(InputError, match="no parity parts"):
        gk.keep(res, into)
    Parts(res / ".fanout_1025_full.parts", "parity").save("case-0", {"key": 1, "value": "first"})
    Parts(res / ".parity_8192.parts", "parity").save("grad_case-1", {"key": 1, "value": "first"})
    (res / ".other.parts").mkdir()
    (res / ".other.parts" / "x.json").write_text("{}")  # no marker: not anchor's parts
    target = gk.keep(res, into)
    assert target == into / "parts_nvidia-h100-80gb-hbm3.tgz"
    with tarfile.open(target) as t:
        names = sorted(t.getnames())
    assert names == [".fanout_1025_full.parts/.anchor-output.json", ".fanout_1025_full.parts/case-0.json",
                     ".parity_8192.parts/.anchor-output.json", ".parity_8192.parts/grad_case-1.json"]
    first = target.read_bytes()
    assert gk.keep(res, into).read_bytes() == first  # reproducible
    nxt = tmp_path / "next"  # the next session: one case computed again, one new
    nxt.mkdir()
    (nxt / "weights.txt").write_text((res / "weights.txt").read_text())
    Parts(nxt / ".fanout_1025_full.parts", "parity").save("case-0", {"key": 2, "value": "again"})
    Parts(nxt / ".fanout_1025_full.parts", "parity").save("case-1", {"key": 2, "value": "new"})
    gk.keep(nxt, into)
    with tarfile.open(target) as t:
        read = {n: json.loads(t.extractfile(n).read()) for n in t.getnames() if not n.endswith("output.json")}
    assert {n: v["value"] for n, v in read.items()} == {".fanout_1025_full.parts/case-0.json": "again",
                                                        ".fanout_1025_full.parts/case-1.json": "new",
                                                        ".parity_8192.parts/grad_case-1.json": "first"}
    (nxt / "weights.txt").write_text("sha only\n")
    with pytest.raises(InputError, match="no GPU named"):
        gk.keep(nxt, into)


def test_each_calls_command_is_ready_to_issue():
    """kit.json's commands (gpu_kit.COMMANDS): each fits the device tool (2,000 characters, timeout_s at most 600),
    names the checkout's commit for the records, runs steps gpu_parity.sh has and brings R back; every carrying
    call has a command."""
    import re

    gk = _kit_module()
    steps = set(re.findall(r"^([a-z]+)\)", (ROOT / "tools" / "gpu_parity.sh").read_text(), re.M))
    commands = gk.call_commands("0123456789ab")
    assert set(gk.CALLS) <= set(commands)
    for call, c in commands.items():
        cmd = c["command"]
        assert len(cmd) <= 2000 and 0 <= c["timeout_s"] <= 600, call
        assert cmd.startswith("export ANCHOR_COMMIT=0123456789ab;") and cmd.endswith("tar --warning=no-file-changed -czf $OUT/r.tgz -C /tmp/res . || [ $? -eq 1 ]")
        used = re.findall(r"\$G (\w+)", cmd)
        assert used and set(used) <= steps, (call, used)
        assert ("{budget}" in cmd) == (c["timeout_s"] == 0), call  # filled when the call is made
    assert "$G start" in commands["1: wheels"]["command"]  # the CUDA tests first
    assert "PROFILE=paper-gpu-short" in commands["3 (paper-gpu): weights part 2, held-out documents"]["command"]
