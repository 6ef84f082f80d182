"""Wrap policies, named and called as in ``torch.distributed.fsdp.wrap``. They pick modules; they never mutate.

A policy is either a callable ``policy(module, recurse, nonwrapped_numel) -> bool`` (the functions
below, usually bound with ``functools.partial``) or a policy object such as ``ModuleWrapPolicy``.
With a callable, ``recurse=True`` asks "may I look inside this module for units?" and
``recurse=False`` asks "should this module become a unit, given that ``nonwrapped_numel``
parameter elements are left in it after its children were considered?".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional, Union

from torch import nn

from flatshard.api import NotBuiltError


def always_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:  # noqa: ARG001, ARG002 - FSDP's policy signature
    return True


def lambda_auto_wrap_policy(  # FSDP's policy signature
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,  # noqa: ARG001
    lambda_fn: Callable[[nn.Module], bool],
) -> bool:
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(  # FSDP's policy signature
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,  # noqa: ARG001
    transformer_layer_cls: Iterable[type],
) -> bool:
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Optional[set[type]] = None,
    exclude_wrap_modules: Optional[set[type]] = None,
) -> bool:
    """Wrap a module once at least ``min_num_params`` elements remain in it; never look inside
    ``force_leaf_modules`` (default: MultiheadAttention) and never wrap ``exclude_wrap_modules``
    (default: ModuleList, ModuleDict), as in PyTorch FSDP."""
    force_leaf = tuple(force_leaf_modules if force_leaf_modules is not None else {nn.MultiheadAttention})
    exclude = tuple(exclude_wrap_modules if exclude_wrap_modules is not None else {nn.ModuleList, nn.ModuleDict})
    large = nonwrapped_numel >= min_num_params
    if recurse:
        return large and not isinstance(module, force_leaf)
    return large and not isinstance(module, exclude)


class ModuleWrapPolicy:
    """Every module whose class is in ``module_classes`` becomes a unit."""

    def __init__(self, module_classes: Iterable[type]):
        self._module_classes = tuple(set(module_classes))

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:  # noqa: ARG001, ARG002 - FSDP's policy signature
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self._module_classes]})"


class CustomPolicy:
    """``lambda_fn(module)`` returns True (wrap) or False; keyword overrides per module are not supported."""

    def __init__(self, lambda_fn: Callable[[nn.Module], Union[bool, dict]]):
        self._fn = lambda_fn

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:  # noqa: ARG001, ARG002 - FSDP's policy signature
        if recurse:
            return True
        decision = self._fn(module)
        if isinstance(decision, dict):
            raise NotBuiltError(
                "CustomPolicy returning per-module keyword overrides is not built in flatshard; return True or "
                "False, and wrap modules that need other keywords by hand (a FullyShardedDataParallel each)."
            )
        return bool(decision)


Policy = Callable[[nn.Module, bool, int], bool]


def select_units(
    root: nn.Module, policy: Optional[Policy], skip: set[nn.Module], ignored_params: set
) -> list[nn.Module]:
    """The modules under ``root`` (not ``root`` itself) that the policy makes units, children first.

    ``skip`` holds modules not to look into (ignored modules, modules already wrapped).
    """
    if policy is None:
        return []
    if isinstance(policy, type):
        name = policy.__name__
        raise TypeError(
            f"auto_wrap_policy={name} is a class, not a policy. To make every {name} a unit pass "
            f"auto_wrap_policy=ModuleWrapPolicy({{{name}}}) (from flatshard.wrap), or "
            f"functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{{name}}})."
        )
    if not callable(policy):
        raise TypeError(
            f"auto_wrap_policy must be a policy object (ModuleWrapPolicy) or a callable such as "
            f"functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{Block}}); got {policy!r}"
        )
    chosen: list[nn.Module] = []

    def own_numel(module: nn.Module) -> int:
        # shard views of units wrapped earlier (``orig_shape``) no longer count as unwrapped elements
        return sum(p.numel() for p in module.parameters() if p not in ignored_params and not hasattr(p, "orig_shape"))

    def visit(module: nn.Module, is_root: bool) -> int:
        """Returns how many elements under ``module`` stay outside units after this visit."""
        total = own_numel(module)
        if module in skip or not policy(module, True, total):
            remaining = total
        else:
            wrapped = 0
            for child in module.children():
                if child in skip:
                    continue
                child_total = own_numel(child)
                child_left = visit(child, False)
                if child in chosen:
                    wrapped += child_total
                else:
                    wrapped += child_total - child_left
            remaining = total - wrapped
        if not is_root and module not in skip and policy(module, False, remaining):
            chosen.append(module)
        return remaining

    visit(root, True)
    return chosen
