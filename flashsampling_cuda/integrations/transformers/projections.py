"""q/k/v and gate/up projections as one GEMM per group (:func:`fuse_projections`, opt-in:
it edits the model in place)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch import Tensor

class _ProjectionGroup:
    """Linears that read the same input, computed as one GEMM over their weights stacked along
    the output dimension (q/k/v of an attention layer, gate/up of an MLP).

    A decode step's projections are skinny GEMMs (B rows): each is bound by streaming its
    weight, and a small one (k_proj, v_proj: 1024 outputs) leaves most SMs idle. One GEMM over
    the stacked weight streams the same bytes with more blocks and fewer launches. The members'
    parameters stay the model's parameters (same objects, names and values); their storage
    becomes a slice of the stacked weight, so in-place updates (``load_state_dict``,
    ``param.data.copy_``) reach the fused GEMM. Where that no longer holds (:meth:`fusable`),
    every member computes its own GEMM again (:class:`_GroupedLinear`).
    """

    def __init__(self, linears: Sequence[nn.Linear]):
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])
            has_bias = linears[0].bias is not None
            self.bias = torch.cat([lin.bias for lin in linears]) if has_bias else None
        self.linears = list(linears)
        self.members, self.pointers, self.splits, start = [], [], [], 0
        for index, lin in enumerate(linears):
            end = start + lin.out_features
            lin.weight.data = self.weight[start:end]
            if has_bias:
                lin.bias.data = self.bias[start:end]
            self.members.append((lin.weight, lin.bias))
            self.pointers.append((lin.weight.data_ptr(), lin.bias.data_ptr() if has_bias else 0))
            self.splits.append(lin.out_features)
            lin.__class__ = _GroupedLinear
            lin._fs_group, lin._fs_index = self, index
            start = end
        self.pending_input: Tensor | None = None  # set by member 0, taken by the others
        self.pending_outputs: list[Tensor | None] = []

    def fusable(self) -> bool:
        """Whether the stacked GEMM computes what the members' own parameters would: every
        member still holds the parameter objects recorded here, with the stacked tensors'
        dtype and device (``module.to(...)`` moves a parameter's data) and, outside
        torch.compile, on their very storage (a ``.data`` assignment moves it); and no gradient
        is being recorded for them (autograd does not know the stacked tensors)."""
        grad = torch.is_grad_enabled()
        compiling = torch.compiler.is_compiling()
        for lin, (weight, bias), (weight_ptr, bias_ptr) in zip(self.linears, self.members, self.pointers):
            if lin.weight is not weight or lin.bias is not bias:
                return False
            if weight.dtype != self.weight.dtype or weight.device != self.weight.device:
                return False
            if grad and (weight.requires_grad or (bias is not None and bias.requires_grad)):
                return False
            if compiling:  # data pointers cannot be traced; identity, dtype and device are guarded
                continue
            if weight.data_ptr() != weight_ptr or (bias is not None and bias.data_ptr() != bias_ptr):
                return False
        return True


class _GroupedLinear(nn.Linear):
    """An ``nn.Linear`` member of a :class:`_ProjectionGroup`: member 0 computes the whole
    group's GEMM and keeps the other members' outputs for their calls on the same input
    tensor (the model's forward calls them in order: q, k, v; gate, up). Anything else (another
    input, a group that is not :meth:`~_ProjectionGroup.fusable`) is a plain linear of the
    member's own parameters."""

    def forward(self, x: Tensor) -> Tensor:
        group, index = self._fs_group, self._fs_index
        if index == 0:
            if not group.fusable():
                group.pending_input, group.pending_outputs = None, []
                return nn.functional.linear(x, self.weight, self.bias)
            outputs = list(nn.functional.linear(x, group.weight, group.bias).split(group.splits, dim=-1))
            group.pending_input, group.pending_outputs = x, outputs
            return outputs[0]
        if group.pending_input is x and group.pending_outputs[index] is not None:
            out = group.pending_outputs[index]
            group.pending_outputs[index] = None
            if all(o is None for o in group.pending_outputs[1:]):
                group.pending_input, group.pending_outputs = None, []
            return out
        return nn.functional.linear(x, self.weight, self.bias)


def fuse_projections(model: nn.Module) -> int:
    """Stacks each decoder layer's q/k/v projections and its MLP's gate/up projections into one
    GEMM per group (:class:`_ProjectionGroup`); returns the number of groups made. The model's
    outputs are unchanged up to the GEMMs' floating-point summation order; its parameters stay
    the same objects (their storage moves into the stacked weights). Already fused groups and
    projections that differ in input size, dtype, device or bias presence are left as they are."""
    groups = 0
    for module in model.modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            linears = [getattr(module, n, None) for n in names]
            if not all(type(lin) is nn.Linear for lin in linears):
                continue
            first = linears[0]
            if any(lin.in_features != first.in_features or lin.weight.dtype != first.weight.dtype
                   or lin.weight.device != first.weight.device or (lin.bias is None) != (first.bias is None)
                   or lin.weight.is_meta for lin in linears):
                continue
            _ProjectionGroup(linears)
            groups += 1
    return groups
