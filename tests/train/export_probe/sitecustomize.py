"""A probe of the checkpoint's hf/ export for tests/train/test_export_sharded.py: put this folder first on
PYTHONPATH; every Python process of the run (the launcher and each spawned rank) then, where ANCHOR_TEST_GATHER_LOG
names a folder, records each `deepspeed.zero.GatheredParameters` that torchtrain.training.export opens as one JSON line in
<folder>/rank-<RANK>.jsonl: the whole shapes and element counts of the parameters it gathers and its modifier_rank.
Test code only: nothing in the product reads this variable."""

import os

_LOG = os.environ.get("ANCHOR_TEST_GATHER_LOG")

if _LOG:
    import json
    import sys

    import deepspeed

    _Gathered = deepspeed.zero.GatheredParameters

    class _Recorded(_Gathered):
        def __init__(self, params, modifier_rank=None, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__") == "torchtrain.training.export":
                listed = list(params) if isinstance(params, (list, tuple)) else [params]
                row = {"shapes": [list(getattr(p, "ds_shape", p.shape)) for p in listed],
                       "numel": [int(getattr(p, "ds_numel", p.numel())) for p in listed],
                       "modifier_rank": modifier_rank}
                with open(os.path.join(_LOG, f"rank-{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
            super().__init__(params, modifier_rank, *args, **kwargs)

    deepspeed.zero.GatheredParameters = _Recorded
