"""A pure-torch stand-in for flash-attn's padding helpers, for CPU machines.

openrlhf.models.ring_attn_utils (imported by openrlhf.models, so by every trainer
module) does ``from flash_attn.bert_padding import index_first_axis, pad_input,
rearrange, unpad_input`` and ``from flash_attn.utils.distributed import all_gather``;
flash-attn needs CUDA to build, so it is never installed on CPU machines.

This module is a pure-torch ``flash_attn.bert_padding`` (flash-attn 2.7 semantics:
``unpad_input`` takes an optional ``unused_mask`` and returns 5 values; OpenRLHF's
``unpad_and_slice_tensor`` unpacks 5) and ``flash_attn.utils.distributed``
(``all_gather`` for ring attention). flash-attn's own versions are pure torch as well;
these keep their autograd behaviour.

:func:`install_flash_attn_shim` registers them in ``sys.modules`` only when flash-attn
is not installed. transformers still reports flash-attn as unavailable (the stand-in
has no version and no file).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import torch
import torch.nn.functional as F

__all__ = [
    "install_flash_attn_shim",
    "index_first_axis",
    "index_put_first_axis",
    "index_first_axis_residual",
    "unpad_input",
    "pad_input",
    "unpad_input_for_concatenated_sequences",
    "all_gather_raw",
    "reduce_scatter_raw",
    "all_gather",
    "reduce_scatter",
]

#: Set on the stand-in modules: tells them from an installed flash-attn.
_SHIM_MARK = "_war_cpu_flash_attn_shim"


def _flatten_tail(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


class _IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` along dim 0; backward scatters the gradient back (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        assert input.ndim >= 2, "index_first_axis: input needs at least 2 dims"
        ctx.save_for_backward(indices)
        ctx.first_axis_dim, other_shape = input.shape[0], input.shape[1:]
        flat = _flatten_tail(input)
        gathered = torch.gather(flat, 0, indices.unsqueeze(1).expand(-1, flat.shape[1]))
        return gathered.reshape(-1, *other_shape)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        other_shape = grad_output.shape[1:]
        flat = _flatten_tail(grad_output)
        grad_input = torch.zeros(ctx.first_axis_dim, flat.shape[1], device=flat.device, dtype=flat.dtype)
        grad_input.scatter_(0, indices.unsqueeze(1).expand(-1, flat.shape[1]), flat)
        return grad_input.reshape(ctx.first_axis_dim, *other_shape), None


class _IndexPutFirstAxis(torch.autograd.Function):
    """A zero tensor of ``first_axis_dim`` rows with ``values`` written at ``indices``."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
        assert indices.ndim == 1, "index_put_first_axis: indices must be 1-D"
        assert values.ndim >= 2, "index_put_first_axis: values needs at least 2 dims"
        ctx.save_for_backward(indices)
        output = torch.zeros(first_axis_dim, *values.shape[1:], device=values.device, dtype=values.dtype)
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


class _IndexFirstAxisResidual(torch.autograd.Function):
    """``(input[indices], input.detach())``; the residual's gradient is added back in backward."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor):
        assert input.ndim >= 2, "index_first_axis_residual: input needs at least 2 dims"
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, grad_residual: torch.Tensor):
        (indices,) = ctx.saved_tensors
        assert grad_residual.shape[1:] == grad_output.shape[1:]
        grad_input = grad_residual
        idx = indices.reshape(indices.shape[0], *((1,) * (grad_output.ndim - 1))).expand_as(grad_output)
        grad_input.scatter_add_(0, idx, grad_output)
        return grad_input.reshape(ctx.first_axis_dim, *grad_output.shape[1:]), None


index_first_axis = _IndexFirstAxis.apply
index_put_first_axis = _IndexPutFirstAxis.apply
index_first_axis_residual = _IndexFirstAxisResidual.apply


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Drop padding: ``(batch, seqlen, ...)`` -> ``(total_nnz, ...)``.

    Returns ``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch)``:
    the kept rows (tokens where ``attention_mask`` or ``unused_mask`` is set, in
    row-major order), their flat indices, int32 cumulative lengths with a leading 0,
    the longest row (a Python int) and the per-row count of ``attention_mask`` tokens.
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(hidden_states.shape[0] * hidden_states.shape[1], *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Unpad rows that each hold several packed samples.

    ``attention_mask_in_length[b]`` lists the lengths of the samples packed in row ``b``
    (then zeros). Returns ``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch)``
    with one ``cu_seqlens`` entry per sample, not per row.
    """
    length = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.size(-1)
    positions = torch.arange(seqlen, device=length.device, dtype=length.dtype).expand(len(length), seqlen)
    attention_mask_2d = positions < length.unsqueeze(1)
    real_indices_idx = torch.nonzero(attention_mask_in_length.flatten(), as_tuple=False).flatten()
    seqlens_in_batch = attention_mask_in_length.flatten()[real_indices_idx]
    indices = torch.nonzero(attention_mask_2d.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(hidden_states.shape[0] * hidden_states.shape[1], *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``(total_nnz, ...)`` -> ``(batch, seqlen, ...)``, zeros at padding."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *output.shape[1:])


def all_gather_raw(input_: torch.Tensor, process_group, async_op: bool = False):
    """Concatenate every rank's ``input_`` along dim 0; returns ``(output, work handle)``."""
    world_size = torch.distributed.get_world_size(process_group)
    output = torch.empty(world_size * input_.shape[0], *input_.shape[1:], dtype=input_.dtype, device=input_.device)
    handle = torch.distributed.all_gather_into_tensor(output, input_.contiguous(), group=process_group,
                                                      async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_: torch.Tensor, process_group, async_op: bool = False):
    """Sum over ranks, then keep this rank's dim-0 slice; returns ``(output, work handle)``."""
    world_size = torch.distributed.get_world_size(process_group)
    assert input_.shape[0] % world_size == 0, "reduce_scatter: dim 0 must divide by the world size"
    output = torch.empty(input_.shape[0] // world_size, *input_.shape[1:], dtype=input_.dtype, device=input_.device)
    handle = torch.distributed.reduce_scatter_tensor(output, input_.contiguous(), group=process_group,
                                                     async_op=async_op)
    return output, handle


class _AllGatherFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, process_group) -> torch.Tensor:
        ctx.process_group = process_group
        output, _ = all_gather_raw(input_, process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_input, _ = reduce_scatter_raw(grad_output, ctx.process_group)
        return grad_input, None


class _ReduceScatterFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, process_group) -> torch.Tensor:
        ctx.process_group = process_group
        output, _ = reduce_scatter_raw(input_, process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_input, _ = all_gather_raw(grad_output, ctx.process_group)
        return grad_input, None


all_gather = _AllGatherFunc.apply
reduce_scatter = _ReduceScatterFunc.apply


def _flash_attn_installed() -> bool:
    if "flash_attn" in sys.modules:
        return not getattr(sys.modules["flash_attn"], _SHIM_MARK, False)
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def _package(name: str, doc: str) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    # A spec keeps importlib.util.find_spec() working; no __file__ and no __version__,
    # so transformers' is_flash_attn_*_available() still says False.
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []  # a package with no submodules on disk: flash_attn.ops etc. stay unimportable
    setattr(mod, _SHIM_MARK, True)
    return mod


def install_flash_attn_shim() -> str | None:
    """Register the stand-in as ``flash_attn`` (with ``bert_padding``, ``utils`` and
    ``utils.distributed``) in ``sys.modules`` unless flash-attn is installed; returns the
    line for :func:`war_openrlhf.cpu.applied_patches`, or ``None`` when nothing was done."""
    if _flash_attn_installed():
        return None
    from einops import rearrange, repeat

    root = _package("flash_attn", f"CPU stand-in for flash-attn ({__name__}): padding helpers only.")
    bert_padding = _package("flash_attn.bert_padding", f"Pure-torch flash_attn.bert_padding ({__name__}).")
    for name in ("index_first_axis", "index_put_first_axis", "index_first_axis_residual", "unpad_input",
                 "pad_input", "unpad_input_for_concatenated_sequences"):
        setattr(bert_padding, name, globals()[name])
    bert_padding.IndexFirstAxis = _IndexFirstAxis
    bert_padding.IndexPutFirstAxis = _IndexPutFirstAxis
    bert_padding.IndexFirstAxisResidual = _IndexFirstAxisResidual
    bert_padding.rearrange, bert_padding.repeat = rearrange, repeat
    utils = _package("flash_attn.utils", "CPU stand-in for flash_attn.utils.")
    distributed = _package("flash_attn.utils.distributed", "Pure-torch flash_attn.utils.distributed.")
    for name in ("all_gather_raw", "reduce_scatter_raw", "all_gather", "reduce_scatter"):
        setattr(distributed, name, globals()[name])
    distributed.AllGatherFunc, distributed.ReduceScatterFunc = _AllGatherFunc, _ReduceScatterFunc
    root.bert_padding, root.utils, utils.distributed = bert_padding, utils, distributed
    for mod in (root, bert_padding, utils, distributed):
        sys.modules[mod.__name__] = mod
    return ("flash_attn: pure-torch flash_attn.bert_padding and flash_attn.utils.distributed in sys.modules "
            "(openrlhf.models.ring_attn_utils imports them; flash-attn is not installed)")
