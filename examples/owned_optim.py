"""Muon on the matrices each rank owns, AdamW on its other parameters: ``train_gpt.py --optimizer muon``.

With ``shard_boundaries="params"`` every parameter lives whole on one rank of its shard group, and
``flatshard.owned_named_parameters(model)`` lists this rank's, in their full shapes. So
``torch.optim.Muon``, which orthogonalises whole matrices, steps each rank's own matrices locally,
with no communication in the step, as a single process would. Muon takes the hidden matrices (the
blocks' qkv, proj, fc and out weights); the embeddings (the token embedding is also the tied head),
norms and biases go to AdamW, as Muon's authors advise, with weight decay on the embeddings only.
``adjust_lr_fn="match_rms_adamw"`` scales Muon's update to AdamW's RMS, so one learning rate (and one
schedule) serves both. A rank may own no matrix, or nothing else: it builds only the optimizers that
have parameters.

``flatshard.checkpoint`` saves and loads one optimizer, whose parameter groups it checks by name
against the saved ones, and the saved ones are rank 0's; here every rank steps other parameters.
``OwnedOptimizers`` presents the two as one optimizer alike on every rank: its ``param_groups`` list
every parameter of each kind (owned here or not: a parameter this rank does not own is an empty shard
view), its ``state`` and ``state_dict()`` are those of the parameters this rank owns, and
``load_state_dict`` hands each owned parameter's state to the optimizer that steps it. Hyperparameters
set on ``param_groups`` (the learning-rate schedule) reach the optimizers at the next ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import flatshard

MUON, DECAY, NO_DECAY = 0, 1, 2  # the three parameter groups, in this order on every rank


def kind_of(name: str, p: nn.Parameter) -> int:
    """Muon for the matrices inside the transformer blocks; AdamW with weight decay for the other
    matrices (the embeddings), without for vectors (norms, biases). Decided on the full shape."""
    ndim = len(getattr(p, "orig_shape", p.shape))
    if name.startswith("blocks.") and ndim == 2:
        return MUON
    return DECAY if ndim >= 2 else NO_DECAY


class OwnedOptimizers:
    """torch.optim.Muon on this rank's owned hidden matrices and torch.optim.AdamW on its other owned
    parameters of ``model`` (wrapped with ``shard_boundaries="params"``), as one optimizer (see above)."""

    def __init__(self, model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        owned = {id(p) for _, p in flatshard.owned_named_parameters(model)}
        hyper = [
            {"lr": lr, "weight_decay": weight_decay},
            {"lr": lr, "weight_decay": weight_decay},
            {"lr": lr, "weight_decay": 0.0},
        ]
        # every parameter of each kind, owned here or not: the same groups on every rank
        self.param_groups = [{**h, "params": [p for n, p in named if kind_of(n, p) == k]} for k, h in enumerate(hyper)]
        mine = [[p for p in g["params"] if id(p) in owned] for g in self.param_groups]
        self.optimizers: list[torch.optim.Optimizer] = []
        self._kinds: list[list[int]] = []  # for each optimizer, the kind of each of its param groups
        if mine[MUON]:
            muon = torch.optim.Muon(mine[MUON], lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
            self._add(muon, [MUON])
        if mine[DECAY] or mine[NO_DECAY]:
            kinds = [k for k in (DECAY, NO_DECAY) if mine[k]]
            adamw = torch.optim.AdamW([{**hyper[k], "params": mine[k]} for k in kinds], lr=lr, betas=betas)
            self._add(adamw, kinds)

    def _add(self, optimizer: torch.optim.Optimizer, kinds: list[int]) -> None:
        self.optimizers.append(optimizer)
        self._kinds.append(kinds)

    def _sync(self) -> None:
        """Every hyperparameter set on ``param_groups`` (the schedule's lr) into the optimizers' groups (read
        anew each time: ``load_state_dict`` replaces an optimizer's group dicts)."""
        for optimizer, kinds in zip(self.optimizers, self._kinds):
            for k, group in zip(kinds, optimizer.param_groups):
                group.update({key: v for key, v in self.param_groups[k].items() if key != "params"})

    # ---- what a training loop calls
    def step(self, closure: Callable | None = None) -> None:
        self._sync()
        for o in self.optimizers:
            o.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every parameter's gradient, owned here or not, as one torch optimizer over all of them would:
        flatshard hands back the reduced gradient as the grad shard itself only when no view holds one."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @property
    def state(self) -> dict:
        """The state of every parameter this rank steps (what ``memory_bytes(opt)`` counts)."""
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    # ---- what flatshard.checkpoint calls
    def state_dict(self) -> dict:
        """torch's layout: ``state`` by index into the parameters of ``param_groups`` (owned ones only)."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state = {}
        for o in self.optimizers:
            theirs = [p for g in o.param_groups for p in g["params"]]
            for j, s in o.state_dict()["state"].items():
                state[index[id(theirs[j])]] = s
        return {"state": state, "param_groups": _indexed(self.param_groups)}

    def load_state_dict(self, state_dict: dict) -> None:
        """The saved hyperparameters into ``param_groups``; each owned parameter's state into its optimizer
        (the states of parameters this rank does not own, empty pieces, are not kept)."""
        everything = [p for g in self.param_groups for p in g["params"]]
        for ours, saved in zip(self.param_groups, state_dict["param_groups"]):
            ours.update({k: v for k, v in saved.items() if k != "params" and k in ours})
        by_param = {id(everything[i]): s for i, s in state_dict["state"].items()}
        for o in self.optimizers:
            theirs = [p for g in o.param_groups for p in g["params"]]
            state = {j: by_param[id(p)] for j, p in enumerate(theirs) if id(p) in by_param}
            o.load_state_dict({"state": state, "param_groups": _indexed(o.param_groups)})
        self._sync()


def _indexed(groups: list[dict]) -> list[dict]:
    """``groups`` as a state dict lists them: hyperparameters, and parameters as indices in order."""
    out, i = [], 0
    for g in groups:
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    return out
