"""A probe of the universal conversion for tests/train/test_resume_other_world.py: put this folder first on
PYTHONPATH; where ANCHOR_TEST_CONVERSION_MARK names a file, DeepSpeed's converter (ds_to_universal), once it has
extracted the ZeRO fragments and before it merges them, creates that file and sleeps, so that the test's `kill -9`
lands in the middle of a conversion. Test code only: nothing in the product reads this variable."""

import os

_MARK = os.environ.get("ANCHOR_TEST_CONVERSION_MARK")

if _MARK:
    import time

    import deepspeed.checkpoint.ds_to_universal as _converter

    _merge = _converter._merge_tp_slice_files

    def _slow_merge(*args, **kwargs):
        open(_MARK, "w").close()
        time.sleep(120)
        return _merge(*args, **kwargs)

    _converter._merge_tp_slice_files = _slow_merge
