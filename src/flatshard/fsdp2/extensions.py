"""``fully_shard`` over parameters that gather themselves: FSDP2's all-gather extensions.

[Note: parameters that gather themselves]
A parameter whose class is a tensor subclass (``TwoTensor``, a float8 weight, any ``torch.Tensor``
subclass but DTensor, which is tensor parallelism: fsdp2/tensor_parallel.py) cannot live in a unit's flat shard: the
flat shard is one plain buffer of one dtype, and such a tensor may hold more than one buffer, or data
that must not be cast. FSDP2 lets its class say how it is gathered: ``fsdp_pre_all_gather`` on this
rank's local shard returns the tensors to all-gather (a bf16 or float8 copy, or each inner tensor) and
metadata; ``fsdp_post_all_gather`` makes the unsharded parameter from the gathered tensors. flatshard
calls the same two methods with FSDP2's arguments, so a class written for FSDP2 works unchanged:

- such a parameter is kept out of the unit's flat shard. Its sharded parameter is a DTensor whose local
  tensor is this rank's chunk along dim 0, of the parameter's own class, in padded storage as FSDP2
  keeps it; the optimizer steps it. The methods are looked up on that local tensor at every gather,
  so methods set on it after the call (``param._local_tensor.fsdp_pre_all_gather = ...``) are used;
- when the unit computes, every such parameter of the unit is gathered by one all-gather of their
  inputs packed into one byte buffer per rank (the design's one all-gather per unit, here a second one
  beside the flat shard's), then ``fsdp_post_all_gather`` runs, first without ``out`` and later with
  ``out=`` the unsharded parameter it returned, whose storage the gathered tensors refill, as FSDP2
  does; a class without ``fsdp_post_all_gather`` computes with its single gathered tensor;
- the unsharded parameter is a leaf that autograd accumulates into; at the end of backward the unit's
  gradients of these parameters are packed (this rank's chunk of each, padded, rank-major) and reduced
  by one reduce-scatter (and an all-reduce across replicas under HSDP) in the reduce dtype, divided as
  the flat gradient is, and put on the sharded DTensors' ``.grad`` in the parameter's dtype, added to a
  gradient already there. Under ``set_requires_gradient_sync(False)`` they accumulate unreduced in the
  reduce dtype until a synchronised backward, as FSDP2 does.

Where it differs from the flat shard's path, and why: the gathered parameters stay in memory from the
gather to the end of their backward (the flat path frees them as soon as the unit's flat gradient is
built, which a parameter outside it cannot tell), and their reduction is not overlapped with backward
(one reduce-scatter per unit at its end). A rank whose ``fsdp_pre_all_gather`` returns an input of
another size than the padded shard (a shorter last shard must be padded, FSDP2's rule) still takes
part in the gather, flagged, and every rank then raises the same error naming the parameter, where
FSDP2 raises on that rank only and leaves the others in the collective.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatshard.api import NotBuiltError
from flatshard.runtime import reduce
from flatshard.runtime.comm import collectives
from flatshard.runtime.comm.mesh import ShardGroups
from flatshard.runtime.comm.streams import Lane
from flatshard.runtime.context import Link, UnitSettings
from flatshard.runtime.grad_state import WindowMarks
from flatshard.runtime.unit import Unit

COMPUTE, GATHER = Lane.COMPUTE, Lane.GATHER
_ALIGN = 16  # each packed input starts at a multiple of this many bytes (any dtype views its slice)


def gathers_itself(param: torch.Tensor) -> bool:
    """Whether ``param`` takes this path: a tensor subclass other than DTensor, or a class defining
    ``fsdp_pre_all_gather``."""
    if isinstance(param, DTensor):
        return False
    return type(param) not in (nn.Parameter, torch.Tensor) or hasattr(type(param), "fsdp_pre_all_gather")


def contiguous_stride(shape) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes():
        storage.resize_(0)


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or a wrapper subclass's inner tensors."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [p for name in names for p in _plain_tensors(getattr(t, name))]


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.nbytes() < nbytes:
        storage.resize_(nbytes)


@dataclass
class Member:
    """One parameter that gathers itself: where the module holds it, its sharded DTensor parameter (the
    object optimizers hold; ``to_empty`` swaps its contents, so its local tensor is read at each use),
    and what the gathers made of it."""

    name: str
    param: nn.Parameter
    uses: list[tuple[nn.Module, str]]
    shape: torch.Size
    padded_rows: int  # rows of every rank's padded shard (FSDP2's padded sharded size)
    as_dtensor: Callable[[torch.Tensor], DTensor]
    outputs: Optional[list[torch.Tensor]] = None  # the gathered inputs, 1-D, kept for refills
    freed: list[torch.Tensor] = field(default_factory=list)  # what fsdp_post_all_gather said to free
    unsharded: Optional[nn.Parameter] = None  # what the module computes with
    unsynced: Optional[torch.Tensor] = None  # gradient accumulated unreduced (set_requires_gradient_sync(False))

    @property
    def local(self) -> torch.Tensor:
        param = self.param
        assert isinstance(param, DTensor)  # a DTensor parameter: nn.Parameter of a DTensor is both
        return param._local_tensor

    @property
    def padded_shape(self) -> torch.Size:
        return torch.Size([self.padded_rows, *self.shape[1:]])

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])


def shard(param: torch.Tensor, shard_size: int, rank: int) -> tuple[torch.Tensor, int]:
    """This rank's chunk of ``param`` along dim 0, of its class, as a view of zero-padded storage of
    ceil(rows / F) rows (FSDP2's chunks: the last ranks may hold fewer rows, or none); and that row count."""
    rows = param.size(0)
    padded_rows = -(-rows // shard_size)
    with torch.no_grad():
        padded = param.detach().new_zeros((padded_rows, *param.shape[1:]))
        lo = min(rank * padded_rows, rows)
        hi = min(lo + padded_rows, rows)
        if hi > lo and not param.is_meta:
            padded[: hi - lo].copy_(param.detach()[lo:hi])
    return padded[: hi - lo], padded_rows


class SelfGathered:
    """A unit's parameters that gather themselves: the engine's ``runtime.unit.SidePath`` (``use_compute`` /
    ``use_sharded`` beside the compute and shard views, ``free`` when the unit reshards, ``reduce`` at the
    end of backward, ``drop_cleared`` before the next forward, ``abandon`` after a step that raised).
    ``link``, ``settings``, ``groups`` and ``reduce_dtype`` are the unit's (its flat group's groups)."""

    def __init__(
        self,
        members: list[Member],
        shard_mesh,
        mp_policy,
        param_dtype: Optional[torch.dtype],
        *,
        link: Link,
        settings: UnitSettings,
        groups: ShardGroups,
        reduce_dtype: torch.dtype,
        device: torch.device,
    ):
        self.members = members
        self.shard_mesh = shard_mesh  # what fsdp_pre_all_gather is given: the 1-D shard mesh
        self.mp_policy = mp_policy
        self.param_dtype = param_dtype
        self.link, self.settings, self.groups = link, settings, groups
        self.reduce_dtype = reduce_dtype
        self.device = device  # where the packed gather goes when no input says
        self.gathered = False
        self.set_on_modules = False
        self.params = {id(m.param) for m in members}
        # [Note: an open accumulation window] (runtime/grad_state.py), for these parameters
        self.marks = WindowMarks(lambda i, t: members[i].as_dtensor(t))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes these parameters hold now on this rank: their local shards, their sharded gradients, and
        what is gathered (the gathered inputs, what fsdp_post_all_gather made, gradients not yet reduced).
        Storages shared between them are counted once."""
        held: dict[str, dict[int, int]] = {"params": {}, "grads": {}, "gathered": {}}

        def add(kind: str, t) -> None:
            if t is None:
                return
            t = t._local_tensor if isinstance(t, DTensor) else t
            for inner in _plain_tensors(t):
                storage = inner.untyped_storage()
                held[kind][storage.data_ptr()] = storage.nbytes()

        for m in self.members:
            add("params", m.param)
            add("grads", m.param.grad)
            for t in (*(m.outputs or ()), *m.freed, m.unsynced, None if m.unsharded is None else m.unsharded.grad):
                add("gathered", t)
        return {kind: sum(v for ptr, v in storages.items() if ptr) for kind, storages in held.items()}

    # ---- gather ----------------------------------------------------------------------------------
    def use_compute(self) -> None:
        """Gather (unless gathered since the last ``free``) and set the unsharded parameters on the modules."""
        if not self.gathered:
            with torch.no_grad():  # pre-backward sets compute views with grad on ([Note: recomputation in backward])
                self._gather()
            self.gathered = True
        for m in self.members:
            unsharded = m.unsharded
            assert unsharded is not None  # made by the first gather
            unsharded.requires_grad_(m.param.requires_grad)
            for module, attr in m.uses:
                module._parameters[attr] = None
                module.__dict__[attr] = unsharded
        self.set_on_modules = True

    def use_sharded(self) -> None:
        if not self.set_on_modules:
            return
        for m in self.members:
            for module, attr in m.uses:
                module.__dict__.pop(attr, None)
                module._parameters[attr] = m.param
        self.set_on_modules = False

    def free(self) -> None:
        """Release the gathered storage (the tensors keep their objects, for autograd and the next refill)."""
        if not self.gathered:
            return
        self.gathered = False
        for m in self.members:
            for t in (*(m.outputs or ()), *m.freed):
                _free(t)

    def _pre_all_gather(self, m: Member) -> tuple[tuple[torch.Tensor, ...], Any]:
        local = m.local
        hook = getattr(local, "fsdp_pre_all_gather", None)
        if hook is None:
            raise NotBuiltError(
                f"{m.name} is a {type(local).__name__}, a tensor subclass without fsdp_pre_all_gather: flatshard "
                "keeps such a parameter out of the unit's flat shard and gathers it only through FSDP2's all-gather "
                "extension. Define fsdp_pre_all_gather (and fsdp_post_all_gather) on its class, or make it a "
                "plain nn.Parameter"
            )
        count = len(inspect.signature(hook).parameters)
        if count == 1:  # FSDP2's first signature: the mesh only
            inputs, metadata = hook(self.shard_mesh)
        elif count == 5:
            shape = torch.Size(m.shape)
            inputs, metadata = hook(self.shard_mesh, shape, contiguous_stride(shape), m.uses[0][0], self.mp_policy)
        else:
            raise TypeError(
                f"{m.name}: fsdp_pre_all_gather takes (mesh) or (mesh, outer_size, outer_stride, module, mp_policy), "
                f"not {count} arguments"
            )
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        return tuple(inputs), metadata

    def _gather(self) -> None:
        """One all-gather of every member's inputs, packed per rank: [status | inputs...], each input at an
        aligned offset. A rank whose inputs break FSDP2's padding rule sends zeros and a status, so every
        rank raises together after the collective."""
        world, link = self.groups.shard_size, self.link
        calls, layout, status, bad = [], [], 0, None
        offset = _ALIGN  # the status word
        for i, m in enumerate(self.members):
            inputs, metadata = self._pre_all_gather(m)
            short = m.local.size() != m.padded_shape
            sizes = []
            for t in inputs:
                size = m.padded_shape if short else t.size()
                if short and t.size() != m.padded_shape and bad is None:
                    status, bad = i + 1, t.size()
                sizes.append((torch.Size(size), t.dtype, offset))
                offset += _aligned(math.prod(size) * t.element_size())
            calls.append((inputs, metadata))
            layout.append(sizes)
        device = next((t.device for inputs, _ in calls for t in inputs), self.device)
        streams, label = link.run.streams, f"{link.name} inputs that gather themselves"
        send = torch.zeros(offset, dtype=torch.uint8, device=device)
        streams.use(COMPUTE, send, "alloc", f"{label} (this rank's)")
        send[:8].view(torch.int64)[0] = status
        if not status:
            for (inputs, _), sizes in zip(calls, layout):
                for t, (size, dtype, at) in zip(inputs, sizes):
                    n = math.prod(size) * t.element_size()
                    send[at : at + n].view(dtype).copy_(t.detach().reshape(-1))
        streams.use(COMPUTE, send, "write", f"{label} (this rank's)")
        received = send
        if world > 1:
            # [Note: stream discipline] (runtime/comm/streams.py), as the flat shard's gather: compute allocates
            # and packs, the gather stream gathers after compute's event, compute reads after the gather's
            received = torch.empty(world * offset, dtype=torch.uint8, device=device)
            streams.use(COMPUTE, received, "alloc", label)
            group = self.groups.shard_group
            assert group is not None  # F > 1: the shard group exists
            streams.order(COMPUTE, GATHER)
            with streams.on(GATHER), torch.profiler.record_function(f"flatshard::all_gather ({label})"):
                streams.use(GATHER, send, "read", f"{label} (this rank's)")
                with link.errors("all_gather"):
                    result = collectives.all_gather(received, send, group, tag=link.next_tag())
                streams.use(GATHER, received, "write", label)
            link.record(result, "shard")
            streams.wait(COMPUTE, streams.record(GATHER))
        streams.use(COMPUTE, received, "read", label)
        rows = received.view(world, offset)
        statuses = [int(s) for s in rows[:, :8].contiguous().view(torch.int64).view(-1).tolist()]
        flagged = [r for r, s in enumerate(statuses) if s]
        if flagged:
            m = self.members[statuses[flagged[0]] - 1]
            raise ValueError(
                f"fsdp_pre_all_gather of {m.name} (shape {tuple(m.shape)}, sharded over {world} ranks) returned "
                f"an all-gather input of another size than the padded shard on rank(s) {flagged} of the shard group"
                + (f" (here {tuple(bad)})" if bad is not None else "")
                + ": where a rank's shard is shorter than the others, each input must be padded "
                + f"to the padded shard size {tuple(m.padded_shape)} (FSDP2's rule). Pad it in fsdp_pre_all_gather"
            )
        for m, (_inputs, metadata), sizes in zip(self.members, calls, layout):
            self._unpack(m, metadata, sizes, rows, world)
        streams.use(COMPUTE, send, "free", f"{label} (this rank's)")
        if received is not send:
            streams.use(COMPUTE, received, "free", label)

    def _unpack(self, m: Member, metadata: Any, sizes: list, rows: torch.Tensor, world: int) -> None:
        first = m.outputs is None
        if m.outputs is None:
            m.outputs = [
                torch.empty(world * math.prod(size), dtype=dtype, device=rows.device) for size, dtype, _ in sizes
            ]
        for t in (*m.outputs, *m.freed):
            _alloc(t)
        for out, (size, dtype, at) in zip(m.outputs, sizes):
            n = math.prod(size) * torch.empty((), dtype=dtype).element_size()
            # through .data: a write with its own version counter, so what autograd saved stays valid
            out.data.view(world, -1).copy_(rows[:, at : at + n].view(dtype))
        gathered = tuple(out.view(-1, *size[1:]) for out, (size, _, _) in zip(m.outputs, sizes))
        dtype = self.param_dtype or m.local.dtype
        post = getattr(m.local, "fsdp_post_all_gather", None)
        if not first:
            if post is not None:
                post(gathered, metadata, dtype, out=m.unsharded)
            return
        if post is None:
            if len(gathered) != 1:
                raise ValueError(
                    f"{m.name}: fsdp_pre_all_gather returned {len(gathered)} inputs but its class has no "
                    "fsdp_post_all_gather to make one parameter of them; define fsdp_post_all_gather"
                )
            unsharded = gathered[0]
        else:
            unsharded, m.freed = post(gathered, metadata, dtype)
            m.freed = list(m.freed)
        shape = torch.Size(m.shape)
        view = torch.as_strided(unsharded, shape, contiguous_stride(shape), storage_offset=0)
        m.unsharded = nn.Parameter(view, requires_grad=m.param.requires_grad)

    # ---- gradients -------------------------------------------------------------------------------
    def reduce(self, sync: bool) -> None:
        """End of backward: take each member's gradient off its unsharded parameter; under
        set_requires_gradient_sync(False) (not ``sync``) keep it unreduced, else reduce every member's at once."""
        reduce_dtype, link = self.reduce_dtype, self.link
        for m in self.members:
            grad = None if m.unsharded is None else m.unsharded.grad
            if m.unsharded is not None:
                m.unsharded.grad = None
            if grad is not None:
                m.unsynced = grad.to(reduce_dtype) if m.unsynced is None else m.unsynced.add_(grad)
        params = [m.param for m in self.members]
        if not sync:
            marked = [i for i, m in enumerate(self.members) if m.unsynced is not None and m.param.requires_grad]
            self.marks.mark(params, marked)
            return
        self.marks.unmark(params)
        ready = [(m, m.unsynced) for m in self.members if m.unsynced is not None]
        if not ready:
            return
        world = self.groups.shard_size
        sizes = [m.padded_rows * m.row_numel for m, _ in ready]
        per_rank = sum(sizes)
        full = torch.zeros(world, per_rank, dtype=reduce_dtype, device=ready[0][1].device)
        at = 0
        for (m, unsynced), n in zip(ready, sizes):
            padded = torch.zeros((world * m.padded_rows, *m.shape[1:]), dtype=reduce_dtype, device=full.device)
            padded[: m.shape[0]].copy_(unsynced)
            full[:, at : at + n].copy_(padded.view(world, n))
            m.unsynced = None
            at += n
        spec = reduce.ReduceSpec(
            self.groups,
            [per_rank] * world,
            reduce_dtype,
            link.name,
            self.settings.gradient_divide_factor,
            streams=link.run.streams,
        )
        kind = "reduce_scatter" if world > 1 else "all_reduce"
        with link.errors(kind):
            pending = reduce.start(full.view(-1), spec, link.record, async_op=False, tag=link.next_tag())
            reduced = reduce.finish(pending, spec, reduce_dtype, link.record, tag=link.next_tag())
        at = 0
        for (m, _), n in zip(ready, sizes):
            local = m.local
            rows = local.size(0)
            piece = reduced[at : at + n].view(m.padded_shape)[:rows].to(local.dtype)
            at += n
            grad = m.as_dtensor(piece)
            if m.param.grad is None:
                m.param.grad = grad
            else:
                assert isinstance(m.param.grad, DTensor)  # as every gradient here (as_dtensor)
                m.param.grad._local_tensor.add_(piece)

    # [Note: an open accumulation window] (runtime/grad_state.py), for these parameters: while their gradients
    # accumulate unreduced, a parameter with no ``.grad`` gets a zero that allocates nothing (a DTensor of a
    # broadcast scalar), and the ``.grad`` object and version are remembered (``self.marks``); before the
    # root's next forward a parameter whose ``.grad`` the loop cleared (``zero_grad()``, ``p.grad = None``, an
    # in-place zero) drops its unreduced part, as on an unwrapped model
    def drop_cleared(self) -> None:
        """Before the root's next forward: drop the unreduced gradient of each parameter the loop cleared."""
        for i in self.marks.drop_cleared([m.param for m in self.members]):
            self.members[i].unsynced = None

    def abandon(self) -> None:
        """A step that raised: drop what backward had not put on ``.grad``, put the sharded parameters back."""
        self.marks.unmark([m.param for m in self.members])
        for m in self.members:
            m.unsynced = None
            if m.unsharded is not None:
                m.unsharded.grad = None
        self.use_sharded()
        self.free()


def attach(unit: Unit, target: nn.Module, named: list, mesh, placements, mp_policy, mp, dims: Optional[dict]) -> None:
    """Give ``unit`` (built by ``fully_shard`` over ``target`` without them) the parameters of ``named``
    that gather themselves: each becomes a DTensor parameter over this rank's chunk of it, of its own
    class, on every module that holds it. ``dims``: what ``shard_placement_fn`` chose, by ``id``."""
    if not named:
        return
    along = [(n, dims[id(p)]) for n, p in named if dims and dims.get(id(p), 0) != 0]
    if along:
        raise NotBuiltError(
            f"shard_placement_fn returned Shard({along[0][1]}) for {along[0][0]}, which gathers itself (FSDP2's "
            "all-gather extension): flatshard shards such parameters along dim 0 only. Return Shard(0) or None "
            "for it"
        )
    if mesh.ndim == 1:
        shard_mesh = mesh
    elif mesh.mesh_dim_names is not None:
        shard_mesh = mesh[mesh.mesh_dim_names[-1]]
    else:
        raise NotBuiltError(
            f"{named[0][0]} gathers itself (FSDP2's all-gather extension), whose fsdp_pre_all_gather is given "
            "the 1-D shard mesh: flatshard cuts it from a 2-D mesh by its dim names. Name the mesh's dims "
            "(init_device_mesh(..., mesh_dim_names=('replicate', 'shard')))"
        )
    group = unit.flat_groups[0]  # the trainable dtype's ([Note: a flat group per dtype], runtime/build/grouping.py)
    if group.offload:
        raise NotBuiltError(
            f"{named[0][0]} gathers itself (a tensor subclass, FSDP2's all-gather extension): flatshard does not "
            "offload such parameters to CPU. Drop CPUOffloadPolicy, or shard them in a fully_shard call of their own"
        )
    shard_dim = mesh.ndim - 1
    size, rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    members = []
    for name, param in named:
        if param.ndim == 0:
            raise ValueError(f"fully_shard doesn't support scalar parameters: {name} is 0-D; make it 1-D")
        shape = param.shape
        local, padded_rows = shard(param, size, rank)

        def as_dtensor(t: torch.Tensor, shape=shape) -> DTensor:
            stride = contiguous_stride(shape)
            return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)

        sharded = nn.Parameter(as_dtensor(local.detach()), requires_grad=param.requires_grad)
        uses = [(m, attr) for m in target.modules() for attr, p in m._parameters.items() if p is param]
        for m, attr in uses:
            m._parameters[attr] = sharded
        members.append(Member(name, sharded, uses, shape, padded_rows, as_dtensor))
    param_dtype = mp.param_dtype if mp is not None else None
    unit.self_gathered = SelfGathered(
        members,
        shard_mesh,
        mp_policy,
        param_dtype,
        link=unit.link,
        settings=unit.settings,
        groups=group.groups,
        reduce_dtype=group.precision.reduce,
        device=group.compute_device,
    )
