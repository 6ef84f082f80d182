"""State dicts of flatshard models: FULL, LOCAL and SHARDED, for modules and optimizers.

``FullyShardedDataParallel``'s state-dict methods delegate here. Not built yet: each entry point
raises ``NotBuiltError`` saying what to use meanwhile.
"""
from __future__ import annotations

from flatshard.api import NotBuiltError

_WHY = (
    "state dicts of flatshard models are not built yet (they land with the checkpoint issue); to read or "
    "set full parameters use `with FullyShardedDataParallel.summon_full_params(model): ...`."
)


def module_state_dict(module, base_state_dict, *args, **kwargs):
    raise NotBuiltError(_WHY)


def load_module_state_dict(module, base_load_state_dict, state_dict, *, strict: bool = True, assign: bool = False):
    raise NotBuiltError(_WHY)


def state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
    raise NotBuiltError(_WHY)


def set_state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
    raise NotBuiltError(_WHY)


def optim_state_dict(model, optim, optim_state_dict=None, group=None):
    raise NotBuiltError(_WHY)


def optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False, group=None):
    raise NotBuiltError(_WHY)
