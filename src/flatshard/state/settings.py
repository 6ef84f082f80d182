"""Which state dict a model gives: ``state_dict_type`` and its configurations, as PyTorch FSDP names them.

The settings live on every host under the module (``UnitHost.state_dict_settings``); the first
host's are the model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from flatshard import interop
from flatshard.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from flatshard.runtime.tree import unit_hosts

CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}
DEFAULT_SETTINGS = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


def settings_of(module: nn.Module) -> StateDictSettings:
    hosts = unit_hosts(module)
    return (hosts[0].state_dict_settings or DEFAULT_SETTINGS) if hosts else DEFAULT_SETTINGS


def set_state_dict_type(
    module, state_dict_type, state_dict_config=None, optim_state_dict_config=None
) -> StateDictSettings:
    state_dict_type, state_dict_config, optim_state_dict_config = map(
        interop.translate, (state_dict_type, state_dict_config, optim_state_dict_config)
    )
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(f"state_dict_type must be a flatshard.StateDictType, got {state_dict_type!r}")
    config_cls, optim_cls = CONFIGS[state_dict_type]
    config = state_dict_config if state_dict_config is not None else config_cls()
    optim_config = optim_state_dict_config if optim_state_dict_config is not None else optim_cls()
    if not isinstance(config, config_cls) or not isinstance(optim_config, optim_cls):
        raise TypeError(
            f"{state_dict_type.name} takes a {config_cls.__name__} and a {optim_cls.__name__}; got "
            f"{type(config).__name__} and {type(optim_config).__name__}"
        )
    if getattr(config, "_use_dtensor", False) or getattr(optim_config, "_use_dtensor", False):
        raise ValueError(
            "_use_dtensor=True is not supported: flatshard's SHARDED values are ShardedTensors (as FSDP's "
            "default); leave _use_dtensor False"
        )
    hosts = unit_hosts(module)
    if not hosts:
        raise ValueError("set_state_dict_type needs a module that contains a FullyShardedDataParallel")
    previous = settings_of(module)
    new = StateDictSettings(state_dict_type, config, optim_config)
    for h in hosts:
        h.state_dict_settings = new
    return previous


@contextlib.contextmanager
def state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None) -> Iterator[None]:
    before = [(h, h.state_dict_settings) for h in unit_hosts(module)]
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for h, old in before:
            h.state_dict_settings = old
