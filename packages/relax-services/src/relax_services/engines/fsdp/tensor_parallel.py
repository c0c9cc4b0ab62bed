"""Tensor parallelism of the text decoder (Megatron-style, with DTensor's ``parallelize_module``): in every block
the query/key/value and the MLP's gate/up projections are split by output features (``ColwiseParallel``), the
attention output and MLP down projections by input features (``RowwiseParallel``), so each block runs two
all-reduces forward (after ``o_proj`` and ``down_proj``) and two backward (the gradients of the block's
replicated inputs). Each rank computes ``heads / tp`` attention heads and ``kv_heads / tp`` key/value heads; the
HF attention reshapes by ``-1`` heads, so the local projections need no change to the model code.

Embeddings, norms, the LM head and the encoders stay replicated over the TP group (FSDP shards them over dp).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

__all__ = ["decoder_tp_plan", "parallelize_decoder"]


def decoder_tp_plan() -> dict[str, ParallelStyle]:
    """The per-block plan (module path inside a decoder block → its parallel style)."""
    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _check_divisible(index: int, block: torch.nn.Module, tp: int) -> None:
    attn: Any = block.get_submodule("self_attn")
    mlp: Any = block.get_submodule("mlp")
    head_dim = int(attn.head_dim)
    sizes = {
        "attention heads": attn.q_proj.out_features // head_dim,
        "key/value heads": attn.k_proj.out_features // head_dim,
        "MLP intermediate size": mlp.gate_proj.out_features,
    }
    for what, n in sizes.items():
        if n % tp:
            raise ValueError(f"tensor parallelism tp={tp} must divide the {what} of decoder block {index}, got {n}")


def parallelize_decoder(blocks: list[torch.nn.Module], tp_mesh: DeviceMesh) -> None:
    """Applies :func:`decoder_tp_plan` to every block in place (before FSDP wraps them).

    Raises:
        ValueError: If ``tp_mesh`` is not 1-D, or its size does not divide a block's attention heads, key/value
            heads or MLP width (naming the block and the number).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"the tensor-parallel mesh must be 1-D, got {tp_mesh.ndim} dimensions")
    tp = tp_mesh.size()
    for index, block in enumerate(blocks):
        _check_divisible(index, block, tp)
    for block in blocks:
        parallelize_module(block, tp_mesh, decoder_tp_plan())


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) over gradients that may live on different meshes, returning the
    global norm.

    With tensor parallelism, FSDP leaves the split projections' gradients on the 2-D ``(dp, tp)`` mesh and the
    replicated ones on ``dp`` alone; torch's function stacks the per-tensor norms and refuses mixed meshes. Here
    each mesh's norm is taken by torch (which counts a replicated dimension once) and made whole, and the norms
    are combined as ``sqrt(Σ n²)``; the clip coefficient is torch's, ``min(1, max_norm / (norm + 1e-6))``,
    computed in float32. One mesh (or none): exactly ``clip_grad_norm_``.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    meshes = {g.device_mesh for g in grads if isinstance(g, DTensor)}
    if len(meshes) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = torch.zeros((), dtype=torch.float32)
    for members in groups.values():
        part = torch.nn.utils.get_total_norm(members)
        whole = part.full_tensor() if isinstance(part, DTensor) else part
        squares = squares + whole.float().cpu() ** 2
    total = squares.sqrt()
    coef = float(torch.clamp(torch.tensor(max_norm, dtype=torch.float32) / (total + 1e-6), max=1.0))
    with torch.no_grad():
        for g in grads:
            g.mul_(coef)
    return float(total)
