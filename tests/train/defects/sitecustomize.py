"""Injected trainer defects for tests/train/test_injected_defects.py: put this folder first on
PYTHONPATH and name the defect in ANCHOR_TEST_DEFECT; every Python process of the run (the
launcher and each spawned rank) then starts with the defect patched into the trainer's modules
(torchtrain.training.trainer, torchtrain.parallel.ulysses, torchtrain.training.optim), which call the patched names
through their modules. Test code only: nothing in the product reads the variable."""

import os

_DEFECT = os.environ.get("ANCHOR_TEST_DEFECT")

if _DEFECT:
    import torchtrain.training.optim as _optim
    import torchtrain.parallel.ulysses as _sp
    import torchtrain.training.trainer as _t

    _right_multiplier, _right_counted, _right_groups = _t.loss_multiplier, _sp.counted_predictions, _optim.param_groups

    if _DEFECT == "per_rank_mean":  # each rank normalises by its own count: a mean of per-rank means
        _t.loss_multiplier = lambda local, glob, world: 1.0 / local.clamp_min(1.0)
    elif _DEFECT == "sp_scaled":  # gradients multiplied by the SP degree (DeepSpeed ALST at ZeRO 0-2)
        _t.loss_multiplier = lambda local, glob, world: 2 * _right_multiplier(local, glob, world)
    elif _DEFECT in ("anchor_counted", "last_counted"):  # the anchor's / the last slot's prediction in the loss
        def _counted(loss_mask):
            counted = _right_counted(loss_mask).clone()
            counted[:, 0 if _DEFECT == "anchor_counted" else -1] = True
            return counted

        _sp.counted_predictions = _counted
    elif _DEFECT == "decay_on_norms":  # the config's no_decay ignored
        _optim.param_groups = lambda model, optim: _right_groups(model, optim.model_copy(update={"no_decay": ()}))
    else:
        raise SystemExit(f"unknown ANCHOR_TEST_DEFECT {_DEFECT!r}")
