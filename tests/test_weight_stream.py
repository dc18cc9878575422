"""anchor_core.weight_stream: a model's tensors one at a time, in the order its shapes announce, equal to what
`load_weights` reads at once, from a sharded Hugging Face folder, a GGUF file and a random preset; the reader
holds one tensor at a time (numpy's allocations traced), and a folder that does not fit its config is refused
from the headers before any data is read."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from anchor_core.errors import InputError
from anchor_core.export import write_model
from anchor_core.weight_stream import stream_weights
from anchor_core.weights import load_weights, random_preset, random_state
from tests.torchtrain.conftest import needs_smollm2


def _sharded(tmp_path, dtype="float32"):
    spec = random_preset("llama")
    return write_model(spec, random_state(spec, 3), tmp_path / "m", max_shard_size="200KB", dtype=dtype)


def _same(name, **kw):
    stream = stream_weights(name, **kw)
    spec, state = load_weights(name, **kw)
    assert stream.spec == spec
    got = list(stream.tensors())
    assert [n for n, _ in got] == list(stream.shapes)
    assert set(stream.shapes) == set(state)
    for n, a in got:
        assert a.dtype == np.float32 and a.shape == stream.shapes[n]
        np.testing.assert_array_equal(a, state[n])
    return stream


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sharded_folder_streams_what_load_weights_reads(tmp_path, dtype):
    folder = _sharded(tmp_path, dtype)
    assert len(list(folder.glob("*.safetensors"))) >= 3
    _same(str(folder))


def test_a_random_preset_streams_its_seeded_weights():
    _same("random:qwen2", seed=5)


@needs_smollm2
def test_the_gguf_streams_what_load_weights_reads():
    _same("default")


def test_the_reader_holds_one_tensor_at_a_time(tmp_path):
    folder = _sharded(tmp_path)
    stream = stream_weights(str(folder))
    sizes = {n: int(np.prod(s)) * 4 for n, s in stream.shapes.items()}
    total, largest = sum(sizes.values()), max(sizes.values())
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        for _name, _array in stream.tensors():
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"peak traced {peak} bytes; largest tensor {largest}, all {total}")
    assert peak < 2.5 * largest < total / 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_reader_reads_in_chunks_and_maps_no_file(tmp_path, monkeypatch, dtype):
    """Each tensor is read into its float32 array a chunk at a time (here about 1001 bytes, cut to whole values: many
    chunks a tensor), the values those load_weights reads, and no weight file is ever mapped into the process, whose
    resident memory would otherwise count the file's pages beside the array."""
    import anchor_core.weight_stream as ws

    monkeypatch.setattr(ws, "_READ_CHUNK", 1001)
    folder = _sharded(tmp_path, dtype)
    mapped = []
    stream = _same(str(folder))
    for _name, _array in stream.tensors():
        with open("/proc/self/maps") as f:
            mapped += [line for line in f if str(folder) in line]
    assert mapped == []


def test_a_mis_shaped_folder_is_refused_from_its_headers(tmp_path):
    folder = _sharded(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="shape mismatch: model.layers.0.mlp"):
        stream_weights(str(folder))
