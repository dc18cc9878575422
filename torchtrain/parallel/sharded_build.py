"""A model built already partitioned over the ranks (ZeRO-3), its weights read a tensor at a time.

    model = build_partitioned("path/to/hf-folder", engine="sdpa", dtype="bfloat16", rope=None, seed=0,
                              ds_config=deepspeed_config(cfg, world.size), group=groups.get_data_parallel_group())

Under DeepSpeed's `zero.Init` every parameter is partitioned as transformers creates it: no process ever holds
the whole model (docs/DESIGN.md §7, sharded construction). The weights then go in one layer at a time: rank 0
reads that layer's tensors from the checkpoint (`anchor_core.weight_stream`: one tensor read at a time), and sends
each rank its slice of each tensor, which it receives into its partition (`_scatter_slices`). A rank's peak is
therefore its partitions, and rank 0's one layer's float32 tensors and one slice besides; no rank gathers a
layer. A parameter DeepSpeed keeps otherwise (offloaded to NVMe, or with hierarchical partitions) is filled
through DeepSpeed's gather instead: every rank gathers it, rank 0 copies the values in, DeepSpeed scatters them. The values are those `build_model` gives, rounded to `dtype` as DeepSpeed's own cast
would round them (to nearest, ties to even).

What `zero.Init` changes and this module puts back: the RoPE buffers (`inv_freq`), which it creates in the
parameters' dtype, are computed again outside it, in float32; and a tied head is tied again, since transformers
does not tie partitioned parameters.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from anchor_core.errors import InputError
from anchor_core.spec import RopeSpec
from anchor_core.weight_stream import WeightStream, stream_weights
from torchtrain.attention.engines import Engine
from torchtrain.model.build import DType, empty_model, with_rope

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def build_partitioned(name: str, *, engine: Engine, dtype: DType, rope: RopeSpec | Mapping[str, Any] | None,
                      seed: int, ds_config: dict[str, Any], group: Any) -> nn.Module:
    """The model `build_model(name, engine, dtype, rope, seed=seed)` would build, its parameters partitioned over
    `group` by DeepSpeed ZeRO-3 (`ds_config`'s) as they are created, then filled one layer at a time (module
    docstring). Every rank of `group` calls this together."""
    import deepspeed

    stream = stream_weights(name, seed=seed)
    spec = with_rope(stream.spec, rope)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, data_parallel_group=group):  # its dtype: the config's (DeepSpeed ignores one given on a CPU)
        model = empty_model(spec, engine, dtype)
    if spec.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _float32_rope(model)
    fill_partitions(model, stream, group)
    return model


def _float32_rope(model: nn.Module) -> None:
    """The RoPE buffers as transformers computes them outside `zero.Init`: float32."""
    for module in model.modules():
        if "inv_freq" in dict(module.named_buffers(recurse=False)):
            fresh = type(module)(config=model.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(module, name, buf)


def fill_partitions(model: nn.Module, stream: WeightStream, group: Any) -> None:
    """Copy `stream`'s tensors into `model`'s ZeRO-3 partitions, a layer at a time: rank 0 of `group` reads,
    every rank gathers the layer's parameters, DeepSpeed scatters rank 0's values. A tensor the model lacks,
    or a parameter no tensor fills, is an InputError on every rank."""
    import deepspeed

    params = dict(model.named_parameters())
    tied_head = stream.spec.tie_embeddings
    names = [n for n in stream.shapes if not (tied_head and n == "lm_head.weight")]
    missing, unexpected = sorted(set(params) - set(names)), sorted(set(names) - set(params))
    if missing or unexpected:
        raise InputError(f"weights do not fit the {stream.spec.family} model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}", path=stream.source)
    reader = stream.tensors() if dist.get_rank(group) == 0 else None
    for layer in _layers(list(stream.shapes)):
        values = _read(reader, layer, group)
        filled = [n for n in layer if n in params]  # a tied head's stored copy is read past: the model has none
        direct = [n for n in filled if _plain_partition(params[n])]
        with torch.no_grad():
            for n in direct:  # rank 0 sends each rank its slice: no rank gathers the whole tensor
                _scatter_slices(params[n], None if values is None else values.pop(n), group)
        rest = [params[n] for n in filled if n not in direct]
        if rest:
            with deepspeed.zero.GatheredParameters(rest, modifier_rank=0):
                if values is not None:
                    with torch.no_grad():
                        for n in filled:
                            if n not in direct:
                                params[n].data.copy_(torch.from_numpy(values[n]))
        del values


def _plain_partition(param: nn.Parameter) -> bool:
    """Whether `param` is a ZeRO-3 parameter partitioned as zero.Init leaves it (its slice in `ds_tensor`, in memory,
    no secondary copy), which `_scatter_slices` fills; any other (NVMe-offloaded, hierarchical) goes through
    DeepSpeed's own gather."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    part = getattr(param, "ds_tensor", None)
    return (part is not None and getattr(param, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE
            and getattr(part, "final_location", None) != OffloadDeviceEnum.nvme
            and getattr(param, "ds_secondary_tensor", None) is None)


def _scatter_slices(param: nn.Parameter, value: Any, group: Any) -> None:
    """Fill `param`'s partitions from rank 0's float32 array `value` (None elsewhere): rank r of `group` holds
    elements [r p, (r + 1) p) of the flattened tensor (p its partition's size; the last one padded, with zeros),
    as DeepSpeed partitions it. Rank 0 converts one slice at a time to the partitions' dtype (rounded to nearest,
    ties to even, as DeepSpeed's own cast rounds) and sends it; the others receive into their partition. Rank 0
    thus holds its float32 array and one slice, and no rank the whole tensor in the run's dtype (DeepSpeed's
    gather holds it twice on every rank: float32, 8 bytes an element beside the array's 4)."""
    part = param.ds_tensor
    size = part.numel()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nccl = dist.get_backend(group) == "nccl"
    wire = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if rank != 0:
        slot = part if part.device == wire else torch.empty(size, dtype=part.dtype, device=wire)
        dist.recv(slot, src=dist.get_global_rank(group, 0), group=group)
        if slot is not part:
            part.copy_(slot)
        return
    flat = torch.from_numpy(value).reshape(-1)
    for r in range(world):
        piece = flat[r * size:(r + 1) * size]
        out = part if r == 0 else torch.empty(size, dtype=part.dtype, device=wire)
        out[:piece.numel()].copy_(piece)
        out[piece.numel():].zero_()
        if r:
            dist.send(out, dst=dist.get_global_rank(group, r), group=group)
        del out


def _layers(names: list[str]) -> Iterator[list[str]]:
    """`names` in runs of one decoder layer's tensors (or one top-level tensor), in their order."""
    run: list[str] = []
    key = None
    for n in names:
        m = _LAYER.match(n)
        k = m.group(1) if m else n
        if run and k != key:
            yield run
            run = []
        run.append(n)
        key = k
    if run:
        yield run


def _read(reader: Iterator | None, layer: list[str], group: Any) -> dict | None:
    """Rank 0 reads the layer's tensors; a reading error is raised on every rank of `group` (the others would
    otherwise wait on a gather rank 0 never joins)."""
    values, error = None, None
    if reader is not None:
        try:
            values = {}
            for _ in layer:
                n, a = next(reader)
                values[n] = a
        except InputError as e:
            error = str(e)
    box = [error]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if box[0] is not None:
        raise InputError(box[0])
    return values
