"""Parameters that gather themselves in the fuzzer (bench/fuzz/): chosen MLP weights of a ``fully_shard``
configuration become ``GathersItself``, a tensor subclass whose ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` (FSDP2's all-gather extension) gather it in its own dtype, padded as FSDP2 asks.
Its arithmetic is its data's, so the reference (the same subclass, unsharded), PyTorch's FSDP2 and
flatshard ([Note: parameters that gather themselves]) must agree as for a plain parameter: what the
fuzzer checks is the extension's machinery (packing, padding, the ``out=`` refill, the gradients'
reduction, accumulation, exceptions, edits and flips).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter


class GathersItself(torch.Tensor):
    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ARG002
        rows = -(-outer_size[0] // mesh.size())
        data = self._data
        if data.size(0) != rows:
            padded = data.new_zeros((rows, *data.shape[1:]))
            padded[: data.size(0)].copy_(data)
            data = padded
        return (data,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):  # noqa: ARG002
        (gathered,) = outputs
        if out is not None:
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.size(0)])
            return None
        cast = gathered.to(param_dtype)
        return cast, (gathered,) if cast is gathered else (gathered, cast)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ARG003
        unwrap = lambda x: x._data  # noqa: E731
        out = func(*pytree.tree_map_only(cls, unwrap, args), **pytree.tree_map_only(cls, unwrap, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):  # noqa: ARG003
        return cls(inner["_data"])

    def __repr__(self):
        return f"{type(self).__name__}({self._data})"


def convert(model: nn.Module, names: list[str]) -> None:
    """Make each named parameter of ``model`` a ``GathersItself`` (same values, same requires_grad)."""
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        p = getattr(owner, attr)
        setattr(owner, attr, nn.Parameter(GathersItself(p.detach().clone()), requires_grad=p.requires_grad))


def plain(t: torch.Tensor) -> torch.Tensor:
    """A ``GathersItself`` (or a DTensor holding one) as the plain tensor of its data, for comparisons."""
    if isinstance(t, GathersItself):
        return t._data
    return t
