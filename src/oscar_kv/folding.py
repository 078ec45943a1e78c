"""Fold the value rotation R_V and the value mean mu_V into v_proj (or a fused qkv_proj's value rows) / o_proj.

For KV head h with value projection v = x W_h^T + b_h, the cache stores v' = (v - mu_h) R_h:
    W_h <- R_h^T W_h,   b_h <- (b_h - mu_h) R_h                       (v_proj rows of head h)
The attention output of query head j (KV head h) is then O'_j = (O_j - mu_h) R_h, because the
softmax weights sum to one.  o_proj undoes both for free:
    W_o[:, j] <- W_o[:, j] R_h,   b_o <- b_o + sum_j W_o[:, j] mu_h       (o_proj columns of head j)
So values are born rotated and centered, and nothing is rotated back at run time.  The original
weights are kept so that another artifact can be folded in later (or the model restored).
"""

from __future__ import annotations

import torch

from .models import AttentionGeometry, projection_rows


def _attention_modules(model):
    return [layer.self_attn for layer in model.model.layers]


def restore_model(model) -> None:
    """Put back the weights saved by the last :func:`fold_values` (no-op if nothing was folded)."""
    saved = getattr(model, "_oscar_original_weights", None)
    if saved is None:
        return
    g = AttentionGeometry.of(model.config)
    for attn, (wv, bv, wo, bo) in zip(_attention_modules(model), saved):
        lin, _ = projection_rows(attn, "v", g)
        lin.weight.data.copy_(wv)
        lin.bias = None if bv is None else torch.nn.Parameter(bv.clone(), requires_grad=False)
        attn.o_proj.weight.data.copy_(wo)
        attn.o_proj.bias = None if bo is None else torch.nn.Parameter(bo.clone(), requires_grad=False)
    model._oscar_original_weights = None
    model._oscar_folded = None


@torch.no_grad()
def fold_values(model, v_rotation: torch.Tensor, v_mean: torch.Tensor, tag: object = None) -> None:
    """Fold per-layer value rotations [L, H|1, D, D] and means [L, Hkv, D] into the model (idempotent per tag).
    The value rows are v_proj's, or the last rows of a fused qkv_proj."""
    if tag is not None and getattr(model, "_oscar_folded", None) is tag:
        return
    restore_model(model)
    g = AttentionGeometry.of(model.config)
    saved = []
    for i, attn in enumerate(_attention_modules(model)):
        lin, rows = projection_rows(attn, "v", g)
        wv, wo = lin.weight, attn.o_proj.weight
        bv = lin.bias
        bo = attn.o_proj.bias
        saved.append((wv.detach().clone(), None if bv is None else bv.detach().clone(),
                      wo.detach().clone(), None if bo is None else bo.detach().clone()))
        rot = v_rotation[i].to(wv.device, torch.float64)  # artifacts load on the CPU; the model may not be
        rot = rot.expand(g.num_kv_heads, g.head_dim, g.head_dim) if rot.shape[0] == 1 else rot
        mu = v_mean[i].to(wv.device, torch.float64)  # [Hkv, D]
        w = wv.detach()[rows].to(torch.float64).reshape(g.num_kv_heads, g.head_dim, -1)
        new_w = torch.einsum("hde,hdk->hek", rot, w)  # R_h^T W_h
        wv[rows] = new_w.reshape(-1, wv.shape[1]).to(wv.dtype)
        b = (bv.detach()[rows].to(torch.float64).reshape(g.num_kv_heads, g.head_dim) if bv is not None
             else torch.zeros_like(mu))
        new_b = torch.einsum("hd,hde->he", b - mu, rot).reshape(-1)
        if bv is not None:
            bv[rows] = new_b.to(bv.dtype)
        elif mu.abs().max() > 0:  # a bias only on the value rows (zeros on a fused projection's q and k rows)
            full = torch.zeros(wv.shape[0], dtype=wv.dtype, device=wv.device)
            full[rows] = new_b.to(wv.dtype)
            lin.bias = torch.nn.Parameter(full, requires_grad=False)
        # o_proj: column block j (query head j) uses the rotation and mean of its KV head.
        wo64 = wo.detach().to(torch.float64).reshape(wo.shape[0], g.num_attention_heads, g.head_dim)
        head_of = torch.arange(g.num_attention_heads, device=wv.device) // g.group
        new_wo = torch.einsum("ojd,jde->oje", wo64, rot[head_of])
        bias_add = torch.einsum("ojd,jd->o", wo64, mu[head_of])
        wo.copy_(new_wo.reshape_as(wo).to(wo.dtype))
        if bo is not None:
            bo.add_(bias_add.to(bo.dtype))
        elif bias_add.abs().max() > 0:
            attn.o_proj.bias = torch.nn.Parameter(bias_add.to(wo.dtype), requires_grad=False)
    model._oscar_original_weights = saved
    model._oscar_folded = tag
