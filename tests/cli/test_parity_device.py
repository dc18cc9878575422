"""`anchor parity --device` (the CPU side): the trainer's side of the parity cases runs on
the device named; without CUDA, `--device cuda` is one line and exit 2 before any work; `--device cpu` is
the CPU suite, recorded in parity.json. `--oracle-device` likewise for jaxref (JAX's backends)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli.helpers import assert_usage_error, run_cli


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: --device cuda runs")
def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys):
    out = tmp_path / "p"
    code, _, err = run_cli(["parity", "--model", "random:llama", "--out", out, "--device", "cuda", "--variants",
                            "anchor", "--policies", "fp32", "--engines", "varlen", "--no-progress"], capsys)
    assert_usage_error(code, err, "parity", "--device cuda: no CUDA device here")
    assert not out.exists()


@pytest.mark.slow  # minutes of CPU: make test-all
def test_device_cpu_runs_and_is_recorded(tmp_path, capsys):
    out = tmp_path / "p"
    code, _, err = run_cli(["parity", "--model", "random:llama", "--out", out, "--device", "cpu", "--variants",
                            "anchor", "--policies", "fp32", "--engines", "varlen", "--seq-len", "97", "--grads",
                            "--no-progress"], capsys)
    assert code == 0, err
    result = json.loads((out / "parity.json").read_text())
    assert result["device"] == "cpu" and result["pass"]
    assert result["oracle_device"].startswith("cpu")  # the default: jaxref on the CPU, its fused kernels


def test_oracle_device_cuda_without_a_jax_gpu_is_one_line(tmp_path, capsys):
    import jaxref  # noqa: F401  (first: it sets XLA's flags, which JAX reads when its backends start)
    import jax

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has a GPU here: --oracle-device cuda runs")
    before = jax.config.jax_platforms
    out = tmp_path / "p"
    code, _, err = run_cli(["parity", "--model", "random:llama", "--out", out, "--oracle-device", "cuda",
                            "--variants", "anchor", "--policies", "fp32", "--engines", "varlen", "--no-progress"], capsys)
    assert_usage_error(code, err, "parity", "--oracle-device cuda: JAX has no cuda backend here")
    assert not out.exists()
    assert jax.config.jax_platforms == before  # the process goes on with the backends it had


def test_a_bad_device_name_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(["parity", "--model", "random:llama", "--out", tmp_path / "p", "--device", "tpu",
                            "--no-progress"], capsys)
    assert_usage_error(code, err, "parity", "--device: expected cpu or cuda, got 'tpu'")
