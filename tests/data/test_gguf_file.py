"""anchor_core.gguf_file reads what the gguf package's GGUFReader reads (metadata values, tensor names, shapes,
types and raw data), and a truncated or malformed file is a ValueError naming the problem; a Qwen3 GGUF
(q/k norm tensors) reads back as the weights written."""

from __future__ import annotations

import numpy as np
import pytest

from anchor_core.gguf_file import read_gguf_file

gguf = pytest.importorskip("gguf")


def assert_same_as_reader(path) -> None:
    ours, ref = read_gguf_file(path), gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # the reader's header pseudo-fields
    assert list(ours.fields) == keys
    for k in keys:
        if ref.fields[k].types[:2] == [gguf.GGUFValueType.ARRAY] * 2:
            continue  # an array of arrays: the reader's contents() flattens it (ours keeps it nested, below)
        assert ours.fields[k] == ref.fields[k].contents(), k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.shape == tuple(int(d) for d in b.shape) and a.tensor_type == b.tensor_type, a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data), equal_nan=True), a.name


def write_sample(path) -> None:
    """Every scalar type, arrays of numbers, strings and arrays, tensors of plain and block types (odd sizes)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2 ** 60 + 3)
    w.add_int64("t.i64", -(2 ** 60))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "Ünïcode ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.strs", ["a", "", "ccc"])
    w.add_array("t.nested", [["x", "y"], ["z"]])
    w.add_tensor("f32", rng.standard_normal((5, 97)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((3, 33)).astype(np.float16))
    w.add_tensor("i32", rng.integers(-9, 9, (7,)).astype(np.int32))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_same_values_as_gguf_reader(tmp_path):
    path = tmp_path / "sample.gguf"
    write_sample(path)
    assert_same_as_reader(path)
    f = read_gguf_file(path)
    assert f.fields["t.nested"] == [["x", "y"], ["z"]] and f.fields["t.str"] == "Ünïcode ✓"
    q8 = next(t for t in f.tensors if t.name == "q8")
    assert q8.data.dtype == np.uint8 and q8.shape == (64, 3)


@pytest.mark.model
def test_the_default_model_as_gguf_reader_reads_it(gguf_path):
    assert_same_as_reader(gguf_path)


def test_truncated_and_malformed_files_are_value_errors(tmp_path):
    path = tmp_path / "sample.gguf"
    write_sample(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    # the writer pads the data section to its alignment (32): the last 31 bytes may be padding
    for n in sorted({0, 3, 4, 8, 23, 24, 40, 100, 333, 700, len(data) // 2, len(data) - 40}):
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError) as e:
            read_gguf_file(cut)
        assert "\n" not in str(e.value) and str(e.value), n
    for bad, needle in ((b"GGUX" + data[4:], "magic"), (data[:4] + (3).to_bytes(4, "big") + data[8:], "big-endian"),
                        (data[:4] + (7).to_bytes(4, "little") + data[8:], "version 7")):
        cut.write_bytes(bad)
        with pytest.raises(ValueError, match=needle):
            read_gguf_file(cut)


def test_safetensors_are_written_with_the_umask_mode(tmp_path):
    """hf/model.safetensors gets the umask's mode, not 0600 (the mode of safetensors' private temporary file)."""
    import os

    from anchor_core.spec import random_preset
    from anchor_core.export import write_model
    from anchor_core.weights import random_state

    umask = os.umask(0o022)
    try:
        spec = random_preset("llama")
        out = write_model(spec, random_state(spec), tmp_path / "hf")
    finally:
        os.umask(umask)
    assert oct(os.stat(out / "model.safetensors").st_mode & 0o777) == oct(0o644)
    assert oct(os.stat(out / "config.json").st_mode & 0o777) == oct(0o644)


@pytest.mark.parametrize("tied", [True, False])
def test_a_qwen3_gguf_reads_as_the_weights_written(tmp_path, tied):
    """A Qwen3 GGUF as llama.cpp's converter names it (gguf's own tensor name map for QWEN3: attn_q_norm,
    attn_k_norm; key_length = head_dim, not hidden / heads; no q/k row permutation) reads back as the
    spec and the float32 weights it was written from."""
    from anchor_core.spec import random_preset
    from anchor_core.weights import load_weights, random_state

    spec = random_preset("qwen3").replace(tie_embeddings=tied)
    state = random_state(spec, seed=2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, spec.num_layers)
    path = tmp_path / "qwen3.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope.base)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_vocab_size(spec.vocab_size)
    w.add_bos_token_id(1)  # Qwen files name one; the toolkit's Qwen has none (slot 0 holds EOS)
    w.add_eos_token_id(spec.eos_token_id)
    for name, x in state.items():
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got_spec, got = load_weights(str(path))
    print(sorted(n for n in got if "norm" in n and "layers.0." in n))
    assert got_spec == spec.replace(rms_norm_eps=float(np.float32(spec.rms_norm_eps)))  # GGUF keeps a float32
    assert set(got) == set(state) and all(np.array_equal(got[k], v) for k, v in state.items())
