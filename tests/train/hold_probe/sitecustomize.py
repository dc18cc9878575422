"""A probe that holds one rank at a moment, for tests/train/test_multinode.py: put this folder first on PYTHONPATH.
In the torchrun worker whose RANK the variable names (the launcher, which has none, is left alone):
  * ANCHOR_TEST_HOLD=RANK:FILE: at its first checkpoint, once DeepSpeed's files are written and before hf/ is
    (torchtrain.training.checkpoint.export_model), the rank creates FILE and sleeps ten minutes, so that the test's kill
    lands while it writes and the other ranks wait in the checkpoint's barrier;
  * ANCHOR_TEST_LINGER=RANK:SECONDS: once it has trained (closing metrics.jsonl, torchtrain.training.metrics.MetricsLog.close,
    the loop's last call), the rank sleeps SECONDS, so that it ends that much later than the others.
Test code only: nothing in the product reads these variables."""

import os

_HOLD = os.environ.get("ANCHOR_TEST_HOLD")
_LINGER = os.environ.get("ANCHOR_TEST_LINGER")
_RANK = os.environ.get("RANK")

if _HOLD and _RANK == _HOLD.partition(":")[0]:
    import time

    import torchtrain.training.checkpoint as _checkpoint

    _export = _checkpoint.export_model
    _mark = _HOLD.partition(":")[2]

    def _held_export(*args, **kwargs):
        if not os.path.exists(_mark):
            open(_mark, "w").close()
            time.sleep(600)
        return _export(*args, **kwargs)

    _checkpoint.export_model = _held_export

if _LINGER and _RANK == _LINGER.partition(":")[0]:
    import time

    import torchtrain.training.metrics as _metrics

    _close = _metrics.MetricsLog.close
    _seconds = float(_LINGER.partition(":")[2])

    def _lingering_close(self):
        _close(self)
        time.sleep(_seconds)

    _metrics.MetricsLog.close = _lingering_close
