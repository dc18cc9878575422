"""`anchor plan`: the predicted peak per term for doubling window lengths, the longest that fits, the term that
stops the next; the same estimate `anchor train` refuses a run by; a tiled MLP's saving is exactly its
intermediate; bad options are one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from anchor_core import shipped
from anchor_core.errors import InputError
from anchor_core.weights import load_spec
from tests.cli.helpers import assert_usage_error, run_cli
from torchtrain.attention import engines
from torchtrain.training import fit
from torchtrain.config import load_train_config
from anchor_core.hardware import GPUS, SHAPES
from torchtrain.training.memory import ALLOCATOR_MARGIN, largest_term, step_memory

GiB = 2**30


def _plan(capsys, *args: str) -> dict:
    code, out, err = run_cli(["plan", "--json", *args], capsys)
    assert code == 0, err
    return json.loads(out)


def test_the_plan_doubles_until_a_window_does_not_fit_and_names_the_longest(capsys):
    plan = _plan(capsys, "--config", "smollm2_2k", "--device", "h100", "--start", "4097",
                 "model.activation_checkpointing=true", "model.tiled_mlp=true")
    rows = plan["rows"]
    assert [r["seq_len"] for r in rows] == [4097 * 2**k for k in range(len(rows))]
    assert all(r["fits"] for r in rows[:-1]) and not rows[-1]["fits"]
    assert plan["longest"] == rows[-2]["seq_len"]
    assert rows[-2]["total_bytes"] <= GPUS["h100"].memory_bytes < rows[-1]["total_bytes"]
    for r in rows:  # the terms are the estimate, nothing else
        assert sum(r["terms_bytes"].values()) * r["procs"] == r["total_bytes"]


def test_the_text_names_the_longest_window_and_the_term_that_stops_the_next(capsys):
    code, out, err = run_cli(["plan", "--config", "smollm2_2k", "--device", "a100-40gb",
                              "model.activation_checkpointing=true"], capsys)
    assert code == 0, err
    lines = out.strip().splitlines()
    plan = _plan(capsys, "--config", "smollm2_2k", "--device", "a100-40gb", "model.activation_checkpointing=true")
    assert lines[-2].startswith(f"longest window that fits: {plan['longest']} ")
    stop = plan["rows"][-1]
    largest = max(stop["terms_bytes"], key=stop["terms_bytes"].get)
    assert lines[-1].startswith(f"{stop['seq_len']} does not fit: ") and f"{largest} the largest term" in lines[-1]


def test_the_plan_and_anchor_trains_refusal_agree(monkeypatch):
    """At this machine's memory (a fixed budget here), train's check passes exactly at the lengths the plan
    says fit."""
    budget = 6 * GiB
    monkeypatch.setattr(engines, "available_memory", lambda device="cpu": budget)
    spec = load_spec("random:llama")
    for T in (2**16, 2**18, 2**20, 2**22, 2**24):
        cfg = load_train_config("tiny", [f"data.seq_len={T}", "model.activation_checkpointing=true",
                                         "model.tiled_mlp=true", "model.engine=varlen"])
        need = step_memory(spec, seq_len=T, micro_batch=cfg.data.micro_batch, dtype=torch.float32, engine="varlen",
                           zero_stage=0, procs=1, activation_checkpointing=True, tiled_mlp=True)
        if need.total <= budget:
            fit.check_step_memory(cfg, spec, T, "varlen", torch.float32)
        else:
            with pytest.raises(InputError, match="needs about") as refused:
                fit.check_step_memory(cfg, spec, T, "varlen", torch.float32)
            line = str(refused.value)
            assert "\n" not in line and f"{largest_term(need)[0]} the largest term" in line
            assert "tiled_mlp: true" not in line and "activation_checkpointing: true" not in line  # already on


def test_a_tiled_mlp_saves_its_intermediate_exactly():
    spec = load_spec("default")
    kw = dict(seq_len=65537, micro_batch=1, dtype=torch.float32, engine="varlen", zero_stage=0, procs=1,
              activation_checkpointing=True)
    plain, tiled = step_memory(spec, **kw), step_memory(spec, tiled_mlp=True, **kw)
    # one layer's recomputation: its 4 i values per slot
    assert dict(plain.parts)["recompute"] - dict(tiled.parts)["recompute"] == 4 * 4 * spec.intermediate_size * 65537
    assert dict(plain.parts)["checkpoints"] == dict(tiled.parts)["checkpoints"]
    for need in (plain, tiled):  # the allocator's margin on every tensor counted
        tensors = need.states + need.dense + sum(b for k, b in need.parts if k != "allocator")
        assert dict(need.parts)["allocator"] == int(ALLOCATOR_MARGIN * tensors)


def test_a_shape_plans_without_weights(capsys):
    plan = _plan(capsys, "--config", "tiny", "--shape", "llama3.1-8b", "--device", "h100", "model.dtype=bfloat16",
                 "parallel.zero_stage=1", "model.activation_checkpointing=true", "model.tiled_mlp=true")
    assert plan["model"] == "llama3.1-8b"
    states = plan["rows"][0]["terms_bytes"]["states"]
    # bf16: weights with the fp32 master, grads, moments (ZeRO-1 over one process shards nothing), and DeepSpeed's
    # reduce and all-gather buckets of hidden_size² bf16 elements each (torchtrain.config.deepspeed_json)
    assert states == int(8_030_261_248 * (6 + 2 + 8)) + 2 * 2 * 4096**2
    assert SHAPES["llama3.1-8b"].spec.num_layers == 32


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "--device: unknown device 'tpu'"),
    (["--shape", "gpt5"], "--shape: unknown shape 'gpt5'"),
    (["--start", "0"], "--start"),
    (["model.tiled_mlpp=true"], "tiled_mlpp"),
    (["--memory", "0"], "--memory must be at least 0.001, got 0.0"),
    (["--memory", "nan"], "--memory must be a finite number, got nan"),
    (["--host-memory", "0"], "--host-memory must be at least 0.001, got 0.0"),
    # beyond the plan's last window, and memory no machine has (an IndexError and OverflowErrors before)
    (["--start", "16777217"], "--start must be at most 16777216, got 16777217"),
    (["--start", str(2**70)], "--start must be at most 16777216"),
    (["--memory", "1e300"], "--memory must be at most 1000000, got 1e+300"),
    (["--host-memory", "1e300"], "--host-memory must be at most 1000000, got 1e+300"),
    (["--memory", "inf"], "--memory must be a finite number, got inf"),
    # tiny's random:llama has 6 heads: Ulysses cannot split them 8 ways, nor a window of 4097 3 ways
    (["parallel.nproc=8", "parallel.sequence_parallel=8"], "sequence_parallel 8 does not divide the model's 6 "
                                                            "attention heads"),
    (["parallel.nproc=3", "parallel.sequence_parallel=3", "--start", "4097"], "sequence_parallel 3 does not divide "
                                                                                  "seq_len 4097"),
])
def test_bad_options_are_one_line_exit_2(args, message, capsys):
    code, _, err = run_cli(["plan", "--config", "tiny", *args], capsys)
    assert_usage_error(code, err, "plan", message)


def test_zero_shards_over_every_gpu_while_each_gpu_holds_one_process(capsys):
    """Eight GPUs: each device holds one process, ZeRO-2 shards the moments, the fp32 master and the gradients
    over all eight, and Ulysses splits each window over them."""
    one = _plan(capsys, "--config", "tiny", "--shape", "llama3.1-8b", "--device", "h100", "model.dtype=bfloat16",
                "parallel.zero_stage=2", "model.activation_checkpointing=true")
    eight = _plan(capsys, "--config", "tiny", "--shape", "llama3.1-8b", "--device", "h100", "model.dtype=bfloat16",
                  "parallel.zero_stage=2", "parallel.nproc=8", "parallel.sequence_parallel=8", "data.global_batch=1",
                  "data.micro_batch=1", "model.activation_checkpointing=true")
    P = 8_030_261_248
    buckets = 2 * 2 * 4096**2  # DeepSpeed's reduce and all-gather buckets, hidden_size² bf16 elements each
    assert one["rows"][0]["terms_bytes"]["states"] == int(P * (6 + 2 + 8)) + buckets  # one process: nothing to shard
    assert eight["rows"][0]["terms_bytes"]["states"] == int(P * (2 + 4 / 8 + 2 / 8 + 8 / 8)) + buckets
    assert all(r["procs"] == 1 for r in eight["rows"]) and eight["world"] == 8
    assert eight["longest"] is not None and (one["longest"] or 0) < eight["longest"]


def test_offloaded_checkpoints_leave_the_device_exactly():
    spec = load_spec("default")
    kw = dict(seq_len=131071, micro_batch=1, dtype=torch.bfloat16, engine="varlen", zero_stage=1, procs=1,
              activation_checkpointing=True, tiled_mlp=True)
    kept, offloaded = step_memory(spec, **kw), step_memory(spec, offload_checkpoints=True, **kw)
    head = (3 * spec.hidden_size * 2 + 2 * spec.head_dim * 4) * 131071  # the final norm's and the rotary tables
    assert offloaded.host == dict(kept.parts)["checkpoints"] - head == 2 * spec.hidden_size * spec.num_layers * 131071
    # the device keeps what is not a layer's checkpoint: the final norm's tensors and the rotary tables; the peak stays
    # the backward's start, with the same gradients held, so the device's tensors fall by exactly what went to the host
    assert dict(offloaded.parts)["checkpoints"] == head
    assert offloaded.states == kept.states
    tensors = [need.states + sum(b for k, b in need.parts if k != "allocator") for need in (kept, offloaded)]
    assert tensors[0] - tensors[1] == offloaded.host


def test_the_peak_is_the_backwards_start_or_its_end():
    """The estimate is the larger of the backward's two ends, each held term by term: at its start every layer's
    checkpoint with the final norm's input, product and output and the rotary tables, the head's and one layer's
    gradients, and the larger of the fused loss's chunk and the last layer's recomputation; at its end every gradient, the first layer's checkpoint and its recomputation; and at
    ZeRO-0 the optimizer step, every gradient beside the larger of DeepSpeed's flat copy of them (its all-reduce)
    and torch's AdamW temporaries (two of the largest parameter's size on the CPU). Short windows peak at the
    optimizer step, long ones at the backward's start."""
    from torchtrain.model.loss import chunk_working_bytes
    from torchtrain.training.memory import activation_bytes_per_slot, largest_parameter, layer_parameters, parameters

    spec = load_spec("default")
    kw = dict(micro_batch=1, dtype=torch.float32, engine="varlen", zero_stage=0, procs=1,
              activation_checkpointing=True, tiled_mlp=True)
    P, early, L = parameters(spec), spec.vocab_size * spec.hidden_size + layer_parameters(spec), spec.num_layers
    kept = 4 * spec.hidden_size  # fp32 bytes of one layer's checkpoint per slot
    head = 3 * 4 * spec.hidden_size + 2 * 4 * spec.head_dim  # the final norm's three and the rotary tables, a slot
    layer = activation_bytes_per_slot(spec, 4, layers=1) - 4 * 4 * spec.intermediate_size  # the tiled MLP's
    stepping = P * 16 + max(2 * 4 * largest_parameter(spec), 4 * P)
    peaks = []
    for T in (97, 1025, 4097, 8193, 65537, 131071):
        need = step_memory(spec, seq_len=T, **kw)
        start = early * 4 + (kept * L + head) * T + max(layer * T, chunk_working_bytes(T, spec.vocab_size, 4))
        end = P * 4 + kept * T + layer * T
        backward = P * (4 + 8) + max(start, end)
        tensors = max(backward, stepping)
        assert need.total == need.base + tensors + int(ALLOCATOR_MARGIN * tensors)
        held = dict(need.parts)
        peaks.append("step" if stepping > backward else "start" if start >= end else "end")
        if peaks[-1] == "step":
            assert held["optimizer step"] == stepping - P * 16 and need.states == P * 16
            continue
        assert held["checkpoints"] == (kept * L + head) * T if start >= end else kept * T
        assert need.states == P * (4 + 8) + (early if start >= end else P) * 4
    assert peaks[0] == "step" and peaks[-1] == "start"


@pytest.mark.parametrize("overrides, message", [
    (["model.offload_checkpoints=true"], "model.offload_checkpoints needs model.activation_checkpointing: true"),
    (["model.offload_checkpoints=true", "model.activation_checkpointing=true"],
     "model.offload_checkpoints moves the checkpoints from a GPU to host memory"),
])
def test_offloading_is_refused_where_it_cannot_serve(overrides, message, tmp_path, capsys):
    if torch.cuda.is_available() and "GPU" in message:
        pytest.skip("this machine trains on a GPU")
    code, _, err = run_cli(["train", "--config", "tiny", "--out", tmp_path / "run", "--no-progress", *overrides],
                           capsys)
    assert_usage_error(code, err, "train", message)
    assert not (tmp_path / "run").exists()


def test_memory_given_replaces_the_devices(capsys):
    """--memory plans for that many GiB whatever the device: the longest window is the last whose total fits."""
    plan = _plan(capsys, "--config", "smollm2_2k", "--memory", "7.5", "model.activation_checkpointing=true")
    assert plan["budget_bytes"] == int(7.5 * GiB)
    fits = [r for r in plan["rows"] if r["total_bytes"] <= int(7.5 * GiB)]
    assert plan["longest"] == fits[-1]["seq_len"] and not plan["rows"][-1]["fits"]


OFFLOAD = ["model.dtype=bfloat16", "model.activation_checkpointing=true", "model.tiled_mlp=true",
           "model.offload_checkpoints=true", "data.micro_batch=1", "data.global_batch=1", "parallel.zero_stage=1"]


def test_offloaded_checkpoints_are_planned_against_the_hosts_memory(capsys):
    """On a GPU the offloaded checkpoints leave the device for the host: the plan counts every process's on the
    host (`--host-memory`) and stops where the host is full even where the device is not."""
    free = _plan(capsys, "--config", "smollm2_2k", "--device", "h100", "--start", "524288", *OFFLOAD)
    assert free["host_budget_bytes"] is None and all(r["host_fits"] is None for r in free["rows"])
    host = {r["seq_len"]: r["host_total_bytes"] for r in free["rows"]}
    spec = load_spec("default")
    assert host[524288] == 2 * spec.hidden_size * spec.num_layers * 524288  # bf16 layer inputs, every layer
    device_longest = free["longest"]
    assert host[device_longest] > 100 * GiB  # what the device-only plan would need of the host
    bounded = _plan(capsys, "--config", "smollm2_2k", "--device", "h100", "--start", "524288", "--host-memory", "100",
                    *OFFLOAD)
    rows = bounded["rows"]
    assert bounded["longest"] < device_longest and rows[-1]["total_bytes"] <= GPUS["h100"].memory_bytes  # the host stops it
    assert rows[-1]["host_fits"] is False and rows[-2]["host_total_bytes"] <= 100 * GiB < rows[-1]["host_total_bytes"]
    two = _plan(capsys, "--config", "smollm2_2k", "--device", "h100", "--start", "524288", "--host-memory", "100",
                *[o for o in OFFLOAD if not o.startswith("data.global_batch")], "parallel.nproc=2",
                "data.global_batch=2")
    assert two["rows"][0]["host_total_bytes"] == 2 * rows[0]["host_total_bytes"]  # two processes, one host
    code, out, err = run_cli(["plan", "--config", "smollm2_2k", "--device", "h100", "--start", "524288",
                              "--host-memory", "100", *OFFLOAD], capsys)
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"{rows[-1]['seq_len']} does not fit: what it offloads needs ") and "host" in last
    code, out, err = run_cli(["plan", "--config", "smollm2_2k", "--device", "h100", "--host-memory", "100"], capsys)
    assert code == 0 and ("host: nothing offloaded (model.offload_checkpoints, parallel.offload_optimizer or "
                          "parallel.offload_params on a GPU), --host-memory not used") in out


def test_train_refuses_offloaded_checkpoints_the_host_cannot_hold(monkeypatch):
    """`anchor train` on a GPU refuses, in one line naming model.offload_checkpoints, a window whose offloaded
    checkpoints exceed the host's available memory; the device's own memory is ample."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engines, "available_memory", lambda device="cpu": 80 * GiB if str(device) == "cuda" else 20 * GiB)
    spec = load_spec("default")
    for T, fits in ((2**18, True), (2**20, False)):  # 8.4 and 33.8 GiB of bf16 layer inputs
        cfg = load_train_config("smollm2_2k", [f"data.seq_len={T}", *OFFLOAD])
        if fits:
            fit.check_step_memory(cfg, spec, T, "varlen", torch.bfloat16)
            continue
        with pytest.raises(InputError, match="model.offload_checkpoints at data.seq_len=1048576 needs about 33.8 GiB "
                                             "of host memory") as refused:
            fit.check_step_memory(cfg, spec, T, "varlen", torch.bfloat16)
        assert "\n" not in str(refused.value)


def test_the_plan_says_where_it_stops_and_what_each_column_counts(capsys):
    """The doubling stops at 2^24 slots: where every window fits up to there the plan says so (and --help says it);
    the table's header says the terms are per process and the total is every process on the device."""
    code, out, err = run_cli(["plan", "--config", "tiny", "--start", "4194304", "--memory", "100000",
                              "model.activation_checkpointing=true", "parallel.nproc=2"], capsys)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[-1] == "the plan stops at 16777216 (2^24) slots: longer windows are not planned"
    assert lines[-2].startswith("longest window that fits: 16777216 ")
    assert "GiB per process, term by term; total: the device's, all 2 process(es) on it" in lines
    plan = _plan(capsys, "--config", "tiny", "--start", "16777216", "--memory", "100000",
                 "model.activation_checkpointing=true")
    assert plan["capped"] is True and plan["stop"] == 2**24 and [r["seq_len"] for r in plan["rows"]] == [2**24]
    assert _plan(capsys, "--config", "tiny", "--memory", "1")["capped"] is False
    code, out, _ = run_cli(["plan", "--help"], capsys)
    assert code == 0 and "16777216 (2^24)" in " ".join(out.replace("│", " ").split())


def test_a_bf16_zero3_runs_states_are_each_byte_divided_once():
    """Llama-3.1-8B in bf16 at ZeRO-3 on 8 processes, computed by hand: 2 bytes of bf16 weights, 2 of gradients
    and 12 of fp32 master weights and AdamW's moments per parameter, divided by 8 (a short window: the backward's
    end, every gradient held, is the peak). The optimizer offloaded: the master, the moments and the CPU
    optimizer's fp32 gradients in host memory; the parameters offloaded too: the weights. Beside them DeepSpeed's
    ZeRO-3 buckets, which the trainer sizes from the hidden size h as transformers does: h² (reduce) + 0.9 h²
    (prefetch) bf16 elements, not sharded."""
    from torchtrain.training.memory import parameters

    spec = SHAPES["llama3.1-8b"].spec
    P = parameters(spec)
    kw = dict(seq_len=97, micro_batch=1, dtype=torch.bfloat16, engine="varlen", zero_stage=3, procs=1, world=8,
              activation_checkpointing=True, tiled_mlp=True)
    h = spec.hidden_size
    buckets = 2 * (h * h + int(0.9 * h * h))
    need = step_memory(spec, **kw)
    print(f"P = {P:,}: states {need.states:,} bytes, by hand {P * (2 + 2 + 4 + 8) // 8 + buckets:,}")
    assert need.states == P * (2 + 2 + 4 + 8) // 8 + buckets == 2 * P + buckets
    optimizer = step_memory(spec, offload_optimizer=True, **kw)
    assert optimizer.states == P * (2 + 2) // 8 + buckets and optimizer.host == P * (4 + 8 + 4) // 8
    both = step_memory(spec, offload_optimizer=True, offload_params=True, **kw)
    assert both.states == P * 2 // 8 + buckets and both.host == P * (2 + 4 + 8 + 4) // 8


@pytest.mark.parametrize("gpus, extra, published", [(1, ["parallel.offload_params=true"], 500_000),
                                                     (8, [], 3_700_000)])
def test_llama_8b_with_offload_plans_alsts_windows(capsys, gpus, extra, published):
    """ALST's recipe for Llama-3.1-8B on H100s (bf16, ZeRO-3, the optimizer states and the checkpoints in host
    memory, the MLP tiled, the loss fused, Ulysses over all the GPUs): the plan's longest window is at least the
    one ALST trained, and the next doubling is refused on the GPU's memory."""
    plan = _plan(capsys, "--config", "smollm2_2k", "--shape", "llama3.1-8b", "--device", "h100", "--start", "131072",
                 "model.dtype=bfloat16", "model.activation_checkpointing=true", "model.tiled_mlp=true",
                 "model.offload_checkpoints=true", "parallel.zero_stage=3", "parallel.offload_optimizer=true",
                 f"parallel.nproc={gpus}", f"parallel.sequence_parallel={gpus}", "data.micro_batch=1",
                 "data.global_batch=1", *extra)
    print({r["seq_len"]: round(r["total_bytes"] / 2**30, 1) for r in plan["rows"]})
    assert plan["longest"] >= published
    assert not plan["rows"][-1]["fits"] and plan["rows"][-1]["total_bytes"] > GPUS["h100"].memory_bytes


@pytest.mark.parametrize("config", shipped.names("train"))
def test_every_shipped_config_plans_on_every_shape_and_device(config, capsys):
    """`anchor plan` prints its table or refuses in one line for every shipped config, with its own model and with
    each --shape, on this machine and on each named GPU: the terms a row names change with the window (the peak
    moves from the optimizer step to the activations), and the table's columns hold every row's."""
    printed = 0
    for shape in [None, *SHAPES]:
        for device in ["here", *GPUS]:
            argv = ["plan", "--config", config, "--device", device] + (["--shape", shape] if shape else [])
            code, out, err = run_cli(argv, capsys)
            if code == 0:
                lines = out.splitlines()
                head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["window"])
                rows = [line.split() for line in lines[head + 1:] 
                        if line.startswith("  ") and line.split()[0].isdigit()]
                assert rows and len({len(r) for r in rows}) == 1, out  # a cell in every column, "-" where none
                printed += 1
            else:
                assert_usage_error(code, err, "plan")
    assert printed > 0, f"{config}: no shape and device printed a table"


# ---------------------------------------------------------------------------------------------
# --window: the smallest split of one window over ranks (torchtrain.training.window_split)

SPLIT = ("--config", "smollm2_2k", "--device", "h100", "model.dtype=bfloat16", "parallel.zero_stage=1",
         "model.activation_checkpointing=true")


def test_a_window_past_one_gpu_is_split_by_the_smallest_count_that_fits(capsys):
    """SmolLM2-135M (9 query heads) at 4M slots on an H100: Ulysses cannot split its heads 2 or 4 ways, context
    parallelism can; the proposal is the first count of ranks whose split fits, each smaller one's best split
    does not, and its total is step_memory's at that split."""
    plan = _plan(capsys, *SPLIT, "--window", "4194304")
    best = plan["proposal"]
    splits = plan["splits"]
    print(best, [(s["ranks"], s["sequence_parallel"], s["context_parallel"], s["fits"], s["refused"]) for s in splits])
    assert best["context_parallel"] > 1 and best["sequence_parallel"] in (1, 3, 9)
    assert not any(s["fits"] for s in splits if s["ranks"] < best["ranks"])
    refused = {(s["sequence_parallel"], s["context_parallel"]): s["refused"] for s in splits if s["refused"]}
    assert "does not divide the model's 9 attention heads" in refused[(2, 1)]
    cfg = load_train_config("smollm2_2k", list(SPLIT[4:]))
    need = step_memory(load_spec(cfg.model.name), seq_len=4194304, micro_batch=1, dtype=torch.bfloat16,
                       engine=plan["engine"], zero_stage=1, procs=1, world=best["ranks"], activation_checkpointing=True,
                       sequence_parallel=best["sequence_parallel"], context_parallel=best["context_parallel"],
                       device="cuda")
    assert need.total == best["total_bytes"] <= plan["budget_bytes"]


def test_context_parallelism_divides_a_ranks_activations_and_counts_the_gathered_keys_and_values():
    """At context parallel C a rank's slots, and with them its checkpoints, are 1/C of the window's; the gathered
    keys and values of the whole window are the one term that does not shrink."""
    spec = load_spec("default")
    kw = dict(seq_len=1 << 20, micro_batch=1, dtype=torch.bfloat16, engine="varlen", zero_stage=1, procs=1,
              activation_checkpointing=True, device="cuda")
    one, four = (step_memory(spec, context_parallel=c, **kw).terms() for c in (1, 4))
    assert four["checkpoints"] * 4 == pytest.approx(one["checkpoints"], rel=1e-6)
    kv = spec.num_kv_heads * (1 << 20) * spec.head_dim
    assert four["gathered kv"] == 2 * kv * 2 + 2 * kv * 4 and "gathered kv" not in one
