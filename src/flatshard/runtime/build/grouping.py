"""A unit's parameters as flat groups: one flat group holds parameters of one dtype, gathered and reduced
over one set of groups, so a ``fully_shard`` call's parameters are split by mesh ([Note: a flat group per
mesh]), then by dtype ([Note: a flat group per dtype]); the FSDP1 wrapper's one flat parameter per unit
needs one dtype (``one_dtype``). build/units.py builds a FlatGroup of each part."""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn

from flatshard.runtime.comm.mesh import ShardGroups
from flatshard.runtime.layout import ParamInfo


class MixedDtypeError(TypeError, AssertionError):
    """Trainable parameters of several dtypes in one ``fully_shard`` call: a TypeError, as flatshard's
    other dtype refusals, and an AssertionError, what FSDP2 raises for them, so code written against
    FSDP2 catches it as it would FSDP2's."""


def _names_by_dtype(params: list[tuple[ParamInfo, nn.Parameter]]) -> str:
    by_dtype: dict[str, list[str]] = {}
    for info, p in params:
        by_dtype.setdefault(str(p.dtype), []).append(info.name)
    return "; ".join(
        f"{d}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}" for d, names in sorted(by_dtype.items())
    )


def one_dtype(name: str, params: list[tuple[ParamInfo, nn.Parameter]]) -> list[tuple[ParamInfo, nn.Parameter]]:
    """``params``, checked to be of one dtype (the FSDP1 wrapper's flat parameter needs one)."""
    if len({p.dtype for _, p in params}) > 1:
        raise TypeError(
            f"unit {name!r} holds parameters of several dtypes ({_names_by_dtype(params)}); one flat parameter "
            "needs one dtype. Cast the model to one dtype first (model.float()), or wrap the modules of each "
            "dtype as separate units."
        )
    return params


# [Note: a flat group per dtype]
# A flat group is one buffer of one dtype, so fully_shard splits a call's parameters by dtype: one flat
# group per dtype, each with its own layout (offsets counted from 0 within the group, in the call's
# parameter order), its own all-gather, and its own precision, resolved from the call's
# MixedPrecisionPolicy against the group's dtype as FSDP2 resolves each parameter's (``param_dtype``
# applies to every floating group, a frozen fp32 group under bf16 gathers in bf16; a group already in
# ``param_dtype`` is not cast, nor is an integer group: precision.py, ``resolve``). As in FSDP2
# (``FSDPParamGroup._init_mp_dtypes``) only the trainable parameters must share one dtype: the group of
# that dtype comes first, holding the frozen parameters of that dtype too, so ``Unit.precision`` (the
# inputs' cast) and the paths that take a unit's first group (the run context's device and process
# group, fully_shard's extensions) read the trainable one. A frozen group is gathered like the others
# (one all-gather per pass) and never reduced: its unsharded flat needs no gradient, so it has no
# post-backward hook, and in backward it stays gathered from its unit's pre-backward to the end of
# backward, as a unit whose parameters are all frozen does (nothing tells the engine earlier that no
# operator of the backward still reads it; FSDP2 frees the call's parameters once gradients reach the
# module's inputs). Where FSDP2 moves a call's mixed dtypes in one uint8 all-gather, flatshard issues one
# per group. The FSDP1 wrapper keeps one flat parameter per unit, which needs one dtype (``one_dtype``).
def dtype_groups(params: list[tuple[ParamInfo, nn.Parameter]]) -> list[list[tuple[ParamInfo, nn.Parameter]]]:
    """``params`` split by dtype, the trainable dtype's group first, each with offsets laid out within it."""
    trainable = list(dict.fromkeys(p.dtype for info, p in params if info.requires_grad))
    if len(trainable) > 1:
        listed = _names_by_dtype([(i, p) for i, p in params if i.requires_grad])
        raise MixedDtypeError(
            f"FSDP expects uniform original parameter dtype but got {{{', '.join(sorted(map(str, trainable)))}}}: "
            f"the trainable parameters of one fully_shard call must share one dtype, and this call's are of "
            f"several ({listed}). Frozen parameters (requires_grad=False) may be of any dtype. Cast the trainable "
            "ones to one dtype before fully_shard (module.to(torch.float32)), freeze those of the other dtype, or "
            "shard the modules of each dtype in fully_shard calls of their own."
        )
    dtypes = list(dict.fromkeys([*trainable, *(p.dtype for _, p in params)]))
    if len(dtypes) <= 1:
        return [params]
    return [_laid_out([(i, p) for i, p in params if p.dtype == dtype]) for dtype in dtypes]


def _laid_out(params: list[tuple[ParamInfo, nn.Parameter]]) -> list[tuple[ParamInfo, nn.Parameter]]:
    """``params`` with their offsets counted from 0 within them, in their order."""
    out, offset = [], 0
    for info, p in params:
        out.append((dataclasses.replace(info, offset=offset), p))
        offset += info.numel
    return out


# [Note: a flat group per mesh]
# fully_shard's ``shard_placement_fn`` may place a parameter on a mesh of its own (FSDP2's
# ``ShardPlacementResult``: an expert-FSDP mesh beside the call's mesh, as MoE models shard experts). A
# flat group is gathered and reduced over one set of groups, so a call's parameters are split by mesh
# first, then each mesh's by dtype ([Note: a flat group per dtype]): one flat group per (mesh, dtype),
# each with its own ShardGroups (the mesh's shard group, no replicate group, F its size, the call's
# process group as the ranks that train the model), its own layout, all-gather and reduce-scatter, and
# gradients divided by its own F, as FSDP2 keys its FSDPParamGroups by process group and divides by each
# group's size. Beside a 2-D (HSDP) call mesh, the call's groups keep their all-reduce over the
# replicas and the other mesh's have none (an FSDPMeshInfo's, in FSDP2 too). The call's mesh comes
# first (its trainable dtype's group is the unit's first group), the others in the order of their first
# parameter. The front end builds the groups and checks that the ranks agree on them (fsdp2/meshes.py);
# the engine only reads ``BuildOptions.param_groups``.
def mesh_groups(
    params: list[tuple[ParamInfo, nn.Parameter]], groups: ShardGroups, by_param: Optional[dict]
) -> list[tuple[ShardGroups, list[tuple[ParamInfo, nn.Parameter]]]]:
    """``params`` split by the groups they are sharded over (``by_param``: id(param) -> ShardGroups,
    default ``groups``), the call's first, each with offsets laid out within it."""
    if not by_param or not params:
        return [(groups, params)]
    split: dict[int, tuple[ShardGroups, list]] = {id(groups): (groups, [])}
    for info, p in params:
        on = by_param.get(id(p), groups)
        split.setdefault(id(on), (on, []))[1].append((info, p))
    parts = [(on, part) for on, part in split.values() if part]
    return [(on, _laid_out(part)) for on, part in parts]
