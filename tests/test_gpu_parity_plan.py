"""tools/gpu_parity.sh's `start` (a GPU session's first call) and `plan` (its calls 3 and 4), dry-run here with
stand-ins for python3, taskset and nvidia-smi that log their arguments: the CUDA tests start first, in the
background, their log naming the commit; what the plan starts in a first call, that it leaves the tests' cores
to them until they end, and that the same plan in the next call skips each step whose report is written and
goes on to the audits."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

pytestmark = pytest.mark.slow  # the GPU session's plan, dry-run with stand-ins: make test-all
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PYTHON3 = """#!/bin/bash
echo "python3 $*" >> "$CALLS"
o=$(echo "$*" | sed -n 's/.*--out \\([^ ]*\\).*/\\1/p')
case "$*" in *"anchor parity"*) [ -n "$FINISH" ] && { mkdir -p "$o"; echo '{}' > "$o/parity.json"; } ;; esac
case "$*" in *"-m pytest"*) sleep "${TESTS_SECONDS:-0}"; echo "pytest ended" >> "$CALLS" ;; esac
exit 0
"""


def _plan(tmp_path: Path, finish: bool, step: str = "plan", keep_log: bool = False,
          **env_extra: str) -> tuple[list[str], str]:
    """(the stand-ins' calls, the step's output) of one `step` (`plan`) in R = tmp_path/res; `finish`: each parity
    run writes its report (else it stops unfinished); `keep_log`: the calls logged before it are kept (and
    returned)."""
    repo, bin_, calls = tmp_path / "repo", tmp_path / "bin", tmp_path / "calls.log"
    if not (repo / "tools" / "gpu_parity.sh").exists():
        (repo / "tools").mkdir(parents=True, exist_ok=True)
        (repo / ".cache" / "models").mkdir(parents=True)
        shutil.copy(ROOT / "tools" / "gpu_parity.sh", repo / "tools")
        (repo / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"weights")
        bin_.mkdir()
        for name, body in (("python3", PYTHON3), ("taskset", '#!/bin/bash\necho "taskset $2 ${*: -2}" >> "$CALLS"; shift 2; exec "$@"\n'),
                           ("nvidia-smi", "#!/bin/bash\necho 'NVIDIA stand-in'\n")):
            (bin_ / name).write_text(body)
            (bin_ / name).chmod(0o755)
    if not keep_log:
        calls.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "CALLS": str(calls), "BUDGET": "300",
           "FINISH": "1" if finish else "", **env_extra}
    p = subprocess.run(["bash", "tools/gpu_parity.sh", str(tmp_path / "res"), step], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    time.sleep(0.5)  # the background steps' stand-ins (diag) log as they start
    return [line for line in calls.read_text().splitlines() if "pip install" not in line], p.stdout


def test_a_first_call_runs_1025_on_the_cpu_oracle_beside_8192_on_cuda_then_the_next_call_goes_on(tmp_path):
    calls, _ = _plan(tmp_path, finish=True)
    fanout = [c for c in calls if "anchor parity" in c and "--seq-len 1025" in c]
    assert sorted(c.split("--variants ")[1].split()[0] for c in fanout) == [
        "anchor", "full", "intra_doc", "intra_doc_reset"]
    assert all("--oracle-device cpu" in c and "--grads" in c for c in fanout)
    long = [c for c in calls if "anchor parity" in c and "--seq-len 8192" in c]
    assert len(long) == 1 and "--oracle-device cuda" in long[0] and "--engines varlen,flex" in long[0]
    assert not any("attn_grad_diag.py" in c for c in calls)  # its inputs are not carried
    assert any("merge_parity.py" in c for c in calls)
    audits = [c for c in calls if "anchor audit" in c]  # 8192 finished in this call: the 4096 audits follow
    assert len(audits) == 2 and all("--seq-len 4096" in c and "--oracle-device cuda" in c for c in audits)

    calls, out = _plan(tmp_path, finish=True)  # the next call: every parity report is there
    assert not [c for c in calls if "anchor parity" in c]
    assert "fanout 1025 anchor: done" in out and "parity 8192: done" in out
    assert len([c for c in calls if "anchor audit" in c]) == 2  # the stand-in wrote no audit: again


def test_the_plan_first_unpacks_the_parts_an_earlier_session_on_this_gpu_kept(tmp_path):
    """`seed`: results/gpu/parity/parts_<gpu>.tgz (made here by `gpu_kit.py keep`, the GPU's name as
    nvidia-smi gives it) unpacked into R once a session, never over a part this session wrote; every parity run
    keeps its parts (--keep-parts) for the next session."""
    import io
    import sys
    import tarfile

    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_kit import PARTS_ARCHIVES, gpu_slug

    archive = tmp_path / "repo" / PARTS_ARCHIVES / f"parts_{gpu_slug('NVIDIA stand-in')}.tgz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:gz") as t:
        for name, text in ((".fanout_1025_full.parts/.anchor-output.json", "{}"),
                           (".fanout_1025_full.parts/case-0.json", "carried"),
                           (".parity_8192.parts/grad_case-3.json", "carried")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            t.addfile(info, io.BytesIO(text.encode()))
    calls, out = _plan(tmp_path, finish=False)
    res = tmp_path / "res"
    assert f"seed: 2 parts from {PARTS_ARCHIVES}/parts_nvidia-stand-in.tgz" in out
    assert (res / ".parity_8192.parts" / "grad_case-3.json").read_text() == "carried"
    assert all("--keep-parts" in c for c in calls if "anchor parity" in c)
    (res / ".fanout_1025_full.parts" / "case-0.json").write_text("this session's")
    (res / ".seeded").unlink()
    _plan(tmp_path, finish=False)
    assert (res / ".fanout_1025_full.parts" / "case-0.json").read_text() == "this session's"
    _, out = _plan(tmp_path, finish=False)
    assert "seed:" not in out  # once a session


def test_an_unfinished_8192_leaves_the_audits_for_a_later_call(tmp_path):
    calls, _ = _plan(tmp_path, finish=False)
    assert [c for c in calls if "--seq-len 8192" in c] and not [c for c in calls if "anchor audit" in c]


def test_the_first_call_starts_the_cuda_tests_and_the_plan_leaves_their_cores_until_they_end(tmp_path):
    """`start`: pytest -m cuda in the background on cores 12-15, once a session, its log headed by the commit
    given; the plan runs T=1025 beside it, T=8192 (cores 12-15) only after the tests have ended."""
    calls, out = _plan(tmp_path, finish=True, step="start", ANCHOR_COMMIT="0123456789ab", TESTS_SECONDS="3")
    assert "tests: started" in out
    assert "taskset 12-15 bg tests" in calls
    calls, _ = _plan(tmp_path, finish=True, keep_log=True)  # call 3 follows at once, the tests still running
    tests = [c for c in calls if "-m pytest" in c]
    assert len(tests) == 1 and "-m cuda tests" in tests[0]
    log = (tmp_path / "res" / "cuda_tests.log").read_text()
    assert log.splitlines()[0] == "commit: 0123456789ab" and "NVIDIA stand-in" in log
    ended, long = calls.index("pytest ended"), next(i for i, c in enumerate(calls) if "--seq-len 8192" in c)
    assert ended < long and any("--seq-len 1025" in c for c in calls[:ended])
    _, out = _plan(tmp_path, finish=True, step="start")
    assert "started already" in out


def test_the_longest_window_step_runs_the_gpu_series_of_the_memory_benchmark(tmp_path):
    calls, _ = _plan(tmp_path, finish=True, step="longest", OFFLOAD="1")
    bench = [c for c in calls if "bench_longest_window.py" in c]
    assert len(bench) == 1 and "--device cuda --start 65536 --offload --out" in bench[0]
    calls, _ = _plan(tmp_path, finish=True, step="train")
    assert any("bench_train_gpu.py --steps 22 --warmup 2" in c for c in calls)  # 20 timed steps a configuration


def test_the_kits_first_command_starts_the_tests_and_brings_r_back(tmp_path):
    """gpu_kit.COMMANDS' first call, as the device tool runs it (bash -c, $OUT set), with the stand-ins."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_kit import call_commands

    _plan(tmp_path, finish=True, step="seed")  # the stand-in repository and tools
    res, out = tmp_path / "res", tmp_path / "out"
    out.mkdir()
    cmd = call_commands("0123456789ab")["1: wheels"]["command"].replace("/tmp/res", str(res))
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls.log"),
           "OUT": str(out), "TESTS_SECONDS": "0"}
    done = subprocess.run(["bash", "-c", cmd], cwd=tmp_path / "repo", env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "tests: started" in done.stdout and (out / "r.tgz").is_file()
    time.sleep(1)
    assert (res / "cuda_tests.log").read_text().startswith("commit: 0123456789ab\n")
