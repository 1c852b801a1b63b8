"""A held-out corpus for the compile benchmark: Liger-Kernel's Triton kernels, which acompile's
cost model was never tuned on (77 compile requests over 64 kernels).

    pip install liger-kernel
    acompile bench --corpus benchmarks/heldout_liger.py --only sequential,anyio_to_process,acompile_cold

The requests are what a user of the library compiles: its norms (RMSNorm, LayerNorm, GroupNorm,
PolyNorm, fused add + RMSNorm, modulated RMSNorm), losses (cross-entropy with and without
softcapping and z-loss, JSD, KL, TVD, GRPO), activations (SwiGLU, GeGLU, ReLU², DyT), rotary
embeddings, softmax and sparsemax, the MoE router and its grouped GEMMs (a few of their autotune
configs each), neighborhood attention and the mHC kernels, each at the block sizes and warp counts
the library's launchers pick for common model widths (``calculate_settings``: a block of the next
power of two of the row, 8 warps from 2048, 16 from 8192, 32 from 32768). The signatures are the
Triton types of the tensors and scalars those launchers pass.

The kernels are imported from the installed library, which imports torch: a pool that imported
their module in its workers would pay that in each of them. Autotuned kernels (DyT, the MoE
GEMMs) are compiled one config at a time, as their ``fn``. The longest compile by far is the mHC
fused matmul + norm (``_mhc_mm_norm_fwd_kernel``: its ``tl.static_range`` over K unrolls 16
dot products; some 7 s on 2 cores, 12 s on a 16-core host), so on 16 workers the bound is that
one compile.
"""

from __future__ import annotations

from typing import Any

import triton.language as tl
from triton.runtime.jit import JITFunction

try:
    from liger_kernel.ops import (
        attn_res,
        cross_entropy,
        dyt,
        fused_add_rms_norm,
        fused_ce_tvd,
        fused_linear_kl_div,
        fused_moe_kernels,
        fused_neighborhood_attention,
        geglu,
        group_norm,
        grpo_loss,
        jsd,
        kl_div,
        layer_norm,
        mhc,
        modulated_rms_norm,
        poly_norm,
        qwen2vl_mrope,
        relu_squared,
        rms_norm,
        rope,
        softmax,
        sparsemax,
        swiglu,
        tvd,
        utils,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"the held-out corpus compiles Liger-Kernel's kernels: pip install liger-kernel ({exc})"
    ) from exc

# Scalars by parameter name; every other runtime parameter named here as a pointer is one, and
# the rest are 32-bit integers (sizes, strides, counts).
_FLOATS = {
    "eps", "offset", "gate_multiplier", "temperature", "scale", "softcap", "sum_non_ignore_weight",
    "weight_sum", "imag_sign", "alpha_eff", "eps_eff",
}  # fmt: skip


def _jit(kernel: Any) -> Any:
    """The JIT function itself (an autotuned kernel's ``fn``: a config is compiled alone)."""
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def _spec(
    name: str,
    kernel: Any,
    ptrs: dict[str, str],
    constexprs: dict[str, Any],
    warps: int = 4,
    stages: int = 3,
    **types: str,
) -> dict[str, Any]:
    """One request: ``ptrs`` maps each pointer parameter to its element type, ``types`` any other
    runtime parameter whose type is not the default (``fp32`` for the names in ``_FLOATS``, else
    ``i32``)."""
    fn = _jit(kernel)
    signature = {}
    for param in fn.params:
        if param.is_constexpr or param.name in constexprs:
            continue
        if param.name in ptrs:
            signature[param.name] = f"*{ptrs[param.name]}"
        elif param.name in types:
            signature[param.name] = types[param.name]
        else:
            signature[param.name] = "fp32" if param.name in _FLOATS else "i32"
    return {
        "name": name,
        "fn": fn,
        "signature": signature,
        "constexprs": constexprs,
        "num_warps": warps,
        "num_stages": stages,
    }


def _own(kernel: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Those of ``values`` that name a parameter of ``kernel`` (kernels of a family share some)."""
    names = {param.name for param in _jit(kernel).params}
    return {name: value for name, value in values.items() if name in names}


def _settings(n: int) -> tuple[int, int]:
    """Liger's ``calculate_settings``: the block for a row of ``n`` and its warps."""
    block = 1 << (n - 1).bit_length()
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps


def _ptrs(dtype: str, *names: str, **others: str) -> dict[str, str]:
    return {**dict.fromkeys(names, dtype), **others}


SPECS: list[dict[str, Any]] = []
_add = SPECS.append

# --- norms ---------------------------------------------------------------------------------------
for hidden, casting in ((4096, 0), (8192, 1)):
    block, warps = _settings(hidden)
    _add(_spec(
        f"rms_norm_fwd_h{hidden}_c{casting}", rms_norm._rms_norm_forward_kernel,
        _ptrs("bf16", "Y_ptr", "X_ptr", "W_ptr", RSTD_ptr="fp32"),
        {"casting_mode": casting, "elementwise_affine": True, "BLOCK_SIZE": block}, warps,
    ))  # fmt: skip
for hidden in (4096, 8192):
    block, warps = _settings(hidden)
    _add(_spec(
        f"rms_norm_bwd_h{hidden}", rms_norm._rms_norm_backward_kernel,
        _ptrs("bf16", "dY_ptr", "dX_ptr", "X_ptr", "W_ptr", RSTD_ptr="fp32", dW_ptr="fp32"),
        {"X_dtype": tl.bfloat16, "casting_mode": 0, "elementwise_affine": True, "BLOCK_SIZE": block},
        warps,
    ))  # fmt: skip
_add(_spec(
    "block_rms_norm_fwd_h1024", rms_norm._block_rms_norm_forward_kernel,
    _ptrs("bf16", "Y_ptr", "X_ptr", "W_ptr", RSTD_ptr="fp32"),
    {"casting_mode": 0, "elementwise_affine": True, "BLOCK_SIZE": 1024, "BLOCK_ROW": 16}, 4,
))  # fmt: skip
_add(_spec(
    "block_rms_norm_bwd_h1024", rms_norm._block_rms_norm_backward_kernel,
    _ptrs("bf16", "dY_ptr", "dX_ptr", "X_ptr", "W_ptr", RSTD_ptr="fp32", dW_ptr="fp32"),
    {"X_dtype": tl.bfloat16, "casting_mode": 0, "elementwise_affine": True, "BLOCK_SIZE": 1024,
     "BLOCK_ROW": 16}, 4,
))  # fmt: skip
for hidden in (4096,):
    block, warps = _settings(hidden)
    _add(_spec(
        f"fused_add_rms_norm_fwd_h{hidden}", fused_add_rms_norm._fused_add_rms_norm_forward_kernel,
        _ptrs("bf16", "Y_ptr", "S_ptr", "X_ptr", "R_ptr", "W_ptr", RSTD_ptr="fp32"),
        {"casting_mode": 0, "BLOCK_SIZE": block}, warps,
    ))  # fmt: skip
_add(_spec(
    "fused_add_rms_norm_bwd_h4096", fused_add_rms_norm._fused_add_rms_norm_backward_kernel,
    _ptrs("bf16", "dY_ptr", "dS_out_ptr", "dX_ptr", "X_ptr", "W_ptr", RSTD_ptr="fp32", dW_ptr="fp32"),
    {"X_dtype": tl.bfloat16, "rows_per_program": 8, "casting_mode": 0, "BLOCK_SIZE": 4096,
     "has_dS_out": True}, 8,
))  # fmt: skip
for hidden in (1024, 4096):
    block, warps = _settings(hidden)
    _add(_spec(
        f"layer_norm_fwd_h{hidden}", layer_norm._layer_norm_forward_kernel,
        _ptrs("bf16", "Y_ptr", "X_ptr", "W_ptr", "B_ptr", Mean_ptr="fp32", RSTD_ptr="fp32"),
        {"BLOCK_SIZE": block}, warps,
    ))  # fmt: skip
    _add(_spec(
        f"layer_norm_bwd_h{hidden}", layer_norm._layer_norm_backward_kernel,
        _ptrs("bf16", "X_ptr", "W_ptr", "DX_ptr", "DY_ptr", Mean_ptr="fp32", RSTD_ptr="fp32",
              DW_ptr="fp32", DB_ptr="fp32"),
        {"rows_per_program": 8, "BLOCK_SIZE": block}, warps,
    ))  # fmt: skip
_add(_spec(
    "group_norm_fwd", group_norm._group_norm_forward_kernel,
    _ptrs("fp32", "Y_ptr", "X_ptr", "Mean_ptr", "RSTD_ptr", "W_ptr", "B_ptr"), {"BLOCK_SIZE": 4096}, 8,
))  # fmt: skip
_add(_spec(
    "group_norm_bwd", group_norm._group_norm_backward_kernel,
    _ptrs("fp32", "X_ptr", "W_ptr", "Mean_ptr", "RSTD_ptr", "DX_ptr", "DW_ptr", "DB_ptr", "UPSTREAM_ptr"),
    {"hidden_size": 4096, "channels_per_group": 8, "BLOCK_SIZE": 4096, "dtype": tl.float32}, 8,
))  # fmt: skip
_add(_spec(
    "poly_norm_fwd_h4096", poly_norm._poly_norm_forward_kernel,
    _ptrs("bf16", "Y_ptr", "X_ptr", W_ptr="fp32", B_ptr="fp32", RSTD_ptr="fp32"), {"BLOCK_SIZE": 4096}, 8,
))  # fmt: skip
_add(_spec(
    "poly_norm_bwd_h4096", poly_norm._poly_norm_backward_kernel,
    _ptrs("bf16", "dY_ptr", "dX_ptr", "X_ptr", W_ptr="fp32", RSTD_ptr="fp32", dW_ptr="fp32", dB_ptr="fp32"),
    {"rows_per_program": 8, "BLOCK_SIZE": 4096}, 8,
))  # fmt: skip
_add(_spec(
    "modulated_rms_norm_fwd_h3072", modulated_rms_norm._modulated_rms_norm_forward_kernel,
    _ptrs("bf16", "Y_ptr", "X_ptr", "W_ptr", "Scale_ptr", "Shift_ptr", RSTD_ptr="fp32"),
    {"casting_mode": 0, "elementwise_affine": True, "has_shift": True, "rows_per_modulation": 256,
     "BLOCK_SIZE": 4096}, 8,
))  # fmt: skip
_add(_spec(
    "modulated_rms_norm_bwd_h3072", modulated_rms_norm._modulated_rms_norm_backward_kernel,
    _ptrs("bf16", "dY_ptr", "dX_ptr", "X_ptr", "W_ptr", "Scale_ptr", RSTD_ptr="fp32", dW_ptr="fp32",
          dScale_ptr="fp32", dShift_ptr="fp32"),
    {"X_dtype": tl.bfloat16, "offset": 0.0, "casting_mode": 0, "elementwise_affine": True, "has_shift": True,
     "rows_per_modulation": 256, "BLOCK_SIZE": 4096}, 8,
))  # fmt: skip

# --- losses --------------------------------------------------------------------------------------
_CE_PTRS = _ptrs("bf16", "X_ptr", Y_ptr="i64", weight_ptr="fp32", loss_ptr="fp32", z_loss_ptr="fp32",
                 token_accuracy_ptr="fp32", predicted_tokens_ptr="i64")  # fmt: skip
for label, softcap, z_loss, smoothing, reduction in (
    ("mean", False, False, 0.0, "mean"),
    ("softcap_zloss", True, True, 0.0, "mean"),
    ("smooth_sum", False, False, 0.1, "sum"),
):
    _add(_spec(
        f"cross_entropy_{label}", cross_entropy.liger_cross_entropy_kernel, _CE_PTRS,
        {"lse_square_scale": 1e-4 if z_loss else 0.0, "label_smoothing": smoothing,
         "reduction": reduction, "RETURN_Z_LOSS": z_loss, "RETURN_TOKEN_ACCURACY": False,
         "RETURN_PREDICTED_TOKENS": False, "BLOCK_SIZE": 32768, "HAS_WEIGHT": False,
         "HAS_SOFTCAPPING": softcap, "HAS_GRADIENTS": True}, 32,
    ))  # fmt: skip
_add(_spec(
    "element_mul", utils.element_mul_kernel, _ptrs("bf16", "X_ptr", grad_output_ptr="fp32"),
    {"BLOCK_SIZE": 32768}, 32,
))  # fmt: skip
for beta in (0.5,):
    _add(_spec(
        f"jsd_beta{beta}", jsd._jsd_kernel,
        _ptrs("fp32", "X_ptr", "Y_ptr", "loss_ptr", "dX_ptr", label_ptr="i64"),
        {"beta": beta, "ignore_index": -100, "BLOCK_SIZE": 16384, "HAS_LABEL": beta == 0.5}, 16,
    ))  # fmt: skip
_add(_spec(
    "kldiv_fwd", kl_div._kldiv_kernel_forward, _ptrs("fp32", "y_ptr", "gt_ptr", "loss_ptr"),
    {"BLOCK_SIZE": 16384, "reduction": 3, "log_target": False}, 16,
))  # fmt: skip
_add(_spec(
    "tv_distance", tvd._tv_distance_kernel,
    _ptrs("fp32", "p_ptr", "q_ptr", "loss_ptr", "grads_ptr", label_ptr="i64"),
    {"ignore_index": -100, "BLOCK_SIZE": 16384, "HAS_LABEL": True, "reduction": "batchmean"}, 16,
))  # fmt: skip
_add(_spec(
    "fused_linear_kl_div", fused_linear_kl_div._kl_div_kernel,
    _ptrs("fp32", "X_ptr", "Q_ptr", "loss_ptr", label_ptr="i64"),
    {"ignore_index": -100, "BLOCK_SIZE": 32768, "HAS_LABEL": True}, 32,
))  # fmt: skip
_TVD_PTRS = _ptrs("fp32", "student_ptr", "teacher_ptr", "ce_ptr", "tvd_ptr", "student_lse_ptr",
                  "teacher_lse_ptr", "sigma_ptr", "grad_ce_ptr", "grad_tvd_ptr", "grad_student_ptr",
                  target_ptr="i64")  # fmt: skip
_add(_spec(
    "fused_ce_tvd_fwd", fused_ce_tvd._fused_ce_tvd_forward_kernel, _TVD_PTRS,
    {"ignore_index": -100, "BLOCK_SIZE": 32768}, 32,
))  # fmt: skip
_add(_spec(
    "fused_ce_tvd_bwd", fused_ce_tvd._fused_ce_tvd_backward_kernel, _TVD_PTRS,
    {"ignore_index": -100, "BLOCK_SIZE": 32768}, 32,
))  # fmt: skip
_GRPO_PTRS = _ptrs("fp32", "OLD_LOGP", "REF_LOGP", "ADVANTAGES", "VLLM_IS_RATIO", "PHI_SEQ", "LOSS",
                   "LSE", "KL", "DLOSS", "DLOSS_SUM", "DKL_SUM", "COEF_1", "COEF_1_RAW", "COEF_2",
                   "SEQ_LEN", "LOG_P", LOGITS="bf16", DLOGITS="bf16", INPUT_IDS="i64",
                   COMPLETION_MASK="i32", MASK="i32", IS_CLIPPED="i1", IS_CLIPPED_SEQ="i1")  # fmt: skip
_add(_spec(
    "selective_log_softmax", grpo_loss._selective_log_softmax_kernel, _GRPO_PTRS,
    {"TEMPERATURE": 1.0, "L": 1024, "N": 151936, "BLOCK_N": 2048}, 1, 4,
))  # fmt: skip
_GRPO = {"TEMPERATURE": 0.9, "BETA": 0.04, "EPS_LOW": 0.2, "EPS_HIGH": 0.2, "LOSS_TYPE": 0,
         "SAPO_TEMP_POS": 1.0, "SAPO_TEMP_NEG": 1.05, "DELTA": 0.0, "USE_BIAS_CORRECTION_KL": False,
         "L": 1024, "N": 151936}  # fmt: skip
_add(_spec("grpo_loss_fwd", grpo_loss._grpo_loss_fwd_kernel, _GRPO_PTRS, {**_GRPO, "BLOCK_N": 2048}, 1, 2))
_add(_spec("grpo_loss_bwd", grpo_loss._grpo_loss_bwd_kernel, _GRPO_PTRS, {**_GRPO, "BLOCK_N": 4096}, 16, 1))

# --- activations ---------------------------------------------------------------------------------
for inter in (11008,):
    block, warps = _settings(inter)
    _add(_spec(
        f"swiglu_fwd_i{inter}", swiglu._swiglu_forward_kernel, _ptrs("bf16", "a_ptr", "b_ptr", "c_ptr"),
        {"n_cols": inter, "BLOCK_SIZE": block}, warps,
    ))  # fmt: skip
    _add(_spec(
        f"swiglu_bwd_i{inter}", swiglu._swiglu_backward_kernel, _ptrs("bf16", "dc_ptr", "a_ptr", "b_ptr"),
        {"n_cols": inter, "BLOCK_SIZE": block}, warps,
    ))  # fmt: skip
_add(_spec(
    "swiglu_fwd_tiled", swiglu._swiglu_forward_kernel_tiled, _ptrs("bf16", "a_ptr", "b_ptr", "c_ptr"),
    {"BLOCK_SIZE": 4096}, 8,
))  # fmt: skip
_add(_spec(
    "swiglu_bwd_tiled", swiglu._swiglu_backward_kernel_tiled, _ptrs("bf16", "dc_ptr", "a_ptr", "b_ptr"),
    {"BLOCK_SIZE": 4096}, 8,
))  # fmt: skip
for kernel, label in ((geglu._geglu_tanh_forward_kernel, "fwd"), (geglu._geglu_tanh_backward_kernel, "bwd")):
    _add(_spec(f"geglu_{label}_i16384", kernel, _ptrs("bf16", "a", "b", "c", "dc"),
               {"n_cols": 16384, "BLOCK_SIZE": 16384}, 16))  # fmt: skip
_add(_spec(
    "relu_squared_fwd", relu_squared._relu_squared_forward_kernel, _ptrs("bf16", "Y_ptr", "X_ptr"),
    {"n_cols": 4096, "BLOCK_SIZE": 4096}, 8,
))  # fmt: skip
_add(_spec(
    "relu_squared_bwd", relu_squared._relu_squared_backward_kernel,
    _ptrs("bf16", "dX_ptr", "dY_ptr", "X_ptr"), {"n_cols": 4096, "BLOCK_SIZE": 4096}, 8,
))  # fmt: skip
for block, stages, warps in ((1024, 1, 4),):
    _add(_spec(
        f"dyt_fwd_b{block}", dyt._dyt_fwd_kernel, _ptrs("bf16", "X", "Y", "Gamma", "Beta", Alpha="fp32"),
        {"HAVE_BETA": True, "N": 4096, "BLOCK_N": block}, warps, stages,
    ))  # fmt: skip
    _add(_spec(
        f"dyt_bwd_b{block}", dyt._dyt_bwd_kernel,
        _ptrs("bf16", "DY", "DX", "X", "Gamma", DA="fp32", DG="fp32", DB="fp32", Alpha="fp32"),
        {"HAVE_BETA": True, "N": 4096, "BLOCK_N": block}, warps, stages,
    ))  # fmt: skip

# --- rotary embeddings, softmax, sparsemax, masks ------------------------------------------------
for backward in (False, True):
    _add(_spec(
        f"rope_{'bwd' if backward else 'fwd'}", rope._triton_rope,
        _ptrs("bf16", "q_ptr", "k_ptr", cos="fp32", sin="fp32"),
        {"bs": 4, "cos_bs": 1, "n_qh": 32, "n_kh": 8, "hd": 128, "pad_n_qh": 32, "pad_n_kh": 8,
         "pad_hd": 128, "pad_rd": 128, "rd": 128, "BLOCK_SIZE": 128, "BACKWARD_PASS": backward},
    ))  # fmt: skip
_add(_spec(
    "qwen2vl_mrope_fwd", qwen2vl_mrope._triton_qwen2vl_mrope,
    _ptrs("bf16", "q_ptr", "k_ptr", cos="fp32", sin="fp32"),
    {"bs": 2, "n_qh": 28, "n_kh": 4, "hd": 128, "pad_n_qh": 32, "pad_n_kh": 4, "pad_hd": 128,
     "mrope_section_t": 16, "mrope_section_h": 24, "BLOCK_SIZE": 128, "BACKWARD_PASS": False},
))  # fmt: skip
for block, warps in ((4096, 8),):
    _add(_spec(
        f"softmax_single_fwd_b{block}", softmax._softmax_single_block_forward_kernel,
        _ptrs("fp32", "Y_ptr", "X_ptr"), {"BLOCK_SIZE": block}, warps,
    ))  # fmt: skip
_add(_spec(
    "softmax_single_bwd", softmax._softmax_single_block_backward_kernel,
    _ptrs("fp32", "dy_ptr", "y_ptr", "dx_ptr"), {"BLOCK_SIZE": 4096}, 8,
))  # fmt: skip
_add(_spec(
    "sparsemax_fwd", sparsemax._sparsemax_forward_kernel, _ptrs("fp32", "x_ptr", "sorted_x_ptr", "o_ptr"),
    {"BLOCK_SIZE": 1024, "num_warps": 4}, 4,
))  # fmt: skip
_add(_spec(
    "sparsemax_bwd", sparsemax._sparsemax_backward_kernel, _ptrs("fp32", "o_ptr", "go_ptr", "gi_ptr"),
    {"BLOCK_SIZE": 1024, "num_warps": 4}, 4,
))  # fmt: skip
_add(_spec(
    "attn_res_fwd", attn_res._attn_res_fwd_kernel,
    _ptrs("bf16", "V_ptr", "W_query_ptr", "W_norm_ptr", "Out_ptr", Alpha_ptr="fp32", RSTD_ptr="fp32"),
    {"eps": 1e-6, "BLOCK_D": 4096, "MAX_BLOCKS": 8}, 8,
))  # fmt: skip
_add(_spec(
    "attn_res_bwd", attn_res._attn_res_bwd_kernel,
    _ptrs("bf16", "dOut_ptr", "V_ptr", "W_query_ptr", "W_norm_ptr", "dV_ptr", Alpha_ptr="fp32",
          RSTD_ptr="fp32", dW_query_ptr="fp32", dW_norm_ptr="fp32"),
    {"BLOCK_D": 4096, "MAX_BLOCKS": 8}, 8,
))  # fmt: skip

# --- MoE: the router, then the grouped GEMMs at a few of their autotune configs ------------------
_add(_spec(
    "moe_router_prefix_sum", fused_moe_kernels._moe_router_prefix_sum_kernel,
    _ptrs("i32", "expert_freq_ptr", "expert_freq_offs_ptr", "expert_tile_offset_ptr", "partial_sum_ptr"),
    {"E": 64, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_M_TOKEN": 64},
))  # fmt: skip
_add(_spec(
    "moe_router_scatter", fused_moe_kernels._moe_router_scatter_kernel,
    _ptrs("i32", "s_scatter_idx_ptr", "s_reverse_scatter_idx_ptr", "x_gather_idx_ptr", "tile_row_start_ptr",
          "tile_expert_ptr", "topk_indices_ptr", "partial_sum_ptr", "expert_offs_ptr",
          "expert_tile_offset_ptr"),
    {"K_POW2": 8, "K": 8, "TOKENS_PER_BLOCK": 128, "BLOCK_M_TOKEN": 64},
))  # fmt: skip
_MOE = {"H_dim": 2048, "I_dim": 768}
_MOE_STRIDES = dict.fromkeys(
    ("stride_x_H", "stride_w_K", "stride_pre_N", "stride_post_N", "stride_post_I", "stride_w_I", "stride_Y_H",
     "stride_dO_H", "stride_d_pre_N", "stride_wact_I", "stride_dout_H", "stride_dW2_I", "stride_dxe_H",
     "stride_dW1_H"), 1,
)  # fmt: skip
_MOE_PTRS = {
    **dict.fromkeys(
        ("x_ptr", "gate_up_proj_ptr", "pre_act_ptr", "post_act_ptr", "down_proj_ptr", "Y_ptr", "dO_ptr",
         "d_pre_act_ptr", "weighted_act_ptr", "dx_expanded_ptr", "dout_ptr", "dW2_ptr", "dW1_ptr"), "bf16"),
    **dict.fromkeys(
        ("x_gather_idx_ptr", "s_scatter_idx_ptr", "expert_start_ptr", "tile_row_start_ptr",
         "tile_expert_ptr"), "i32"),
    "topk_weights_ptr": "fp32",
    "dS_ptr": "fp32",
}  # fmt: skip
for kernel, label, configs in (
    (fused_moe_kernels._fused_up_proj_swiglu_kernel, "up_proj_swiglu", ((128, 64, 8, 3), (64, 32, 4, 4))),
    (fused_moe_kernels._fused_down_proj_kernel, "down_proj", ((128, 64, 8, 3), (64, 32, 4, 2))),
    (fused_moe_kernels._moe_bwd_down_proj_kernel, "bwd_down_proj", ((128, 64, 8, 2), (64, 32, 4, 4))),
    (fused_moe_kernels._moe_bwd_dX_expanded_kernel, "bwd_dx", ((128, 64, 8, 3), (64, 64, 4, 5))),
):
    for bn, bk, warps, stages in configs:
        _add(_spec(
            f"moe_{label}_n{bn}_k{bk}_w{warps}_s{stages}", kernel, _MOE_PTRS,
            {**_MOE, **_own(kernel, _MOE_STRIDES), "BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": bk},
            warps, stages,
        ))  # fmt: skip
for kernel, label in (
    (fused_moe_kernels._moe_bwd_dW1_kernel, "dw1"),
    (fused_moe_kernels._moe_bwd_dW2_kernel, "dw2"),
):
    for bm, bn, bk, warps in ((64, 128, 32, 8), (128, 64, 16, 4)):
        _add(_spec(
            f"moe_bwd_{label}_m{bm}_n{bn}_k{bk}_w{warps}", kernel, _MOE_PTRS,
            {**_MOE, **_own(kernel, _MOE_STRIDES), "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, warps, 2,
        ))  # fmt: skip
_add(_spec(
    "moe_token_gather_sum", fused_moe_kernels._token_gather_weighted_sum_kernel,
    {"Y_ptr": "bf16", "w_ptr": "fp32", "s_rev_ptr": "i32", "out_ptr": "bf16"},
    {"H_dim": 2048, "K_dim": 8, "stride_Y_H": 1, "stride_out_H": 1, "BLOCK_H": 256, "BLOCK_K": 8,
     "w_is_None": False}, 8, 4,
))  # fmt: skip

# --- neighborhood attention (batch 2, 16 heads, 1024 tokens, head 64) ----------------------------
_NA = {"batch_size": 2, "num_heads": 16, "seq_len": 1024, "head_dim": 64}
_NA_PTRS = dict.fromkeys(
    ("Q_ptr", "K_ptr", "V_ptr", "QK_ptr", "Attn_ptr", "Out_ptr", "grad_attn_ptr", "grad_Q_ptr", "grad_K_ptr",
     "grad_V_ptr", "grad_output_ptr", "mask_ptr"), "fp32",
)  # fmt: skip
_NA_TILE = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "num_stages": 4, "num_warps": 16}
_add(_spec(
    "na_qk", fused_neighborhood_attention._fused_neighborhood_attention_qk_kernel, _NA_PTRS,
    {**_NA, "scale": 0.125, "kernel_size": 7, "dilation": 1, **_NA_TILE, "BLOCK_SIZE_K": 64}, 16, 4,
))  # fmt: skip
_add(_spec(
    "na_av", fused_neighborhood_attention._fused_neighborhood_attention_av_kernel, _NA_PTRS,
    {**_NA, **_NA_TILE, "BLOCK_SIZE_K": 64}, 16, 4,
))  # fmt: skip
for kernel, label, scaled in (
    (fused_neighborhood_attention._fused_neighborhood_attention_grad_qk_kernel, "grad_qk", True),
    (fused_neighborhood_attention._fused_neighborhood_attention_grad_k_kernel, "grad_k", True),
    (fused_neighborhood_attention._fused_neighborhood_attention_grad_v_kernel, "grad_v", False),
    (fused_neighborhood_attention._fused_neighborhood_attention_grad_attn_kernel, "grad_attn", False),
):
    _add(_spec(
        f"na_{label}", kernel, _NA_PTRS,
        {**_NA, **({"scale": 0.125} if scaled else {}), **_NA_TILE, "BLOCK_SIZE_K": 64}, 16, 4,
    ))  # fmt: skip

# --- mHC (hyper-connections, 4 streams of 1024): the fused matmul + norm, Sinkhorn, pre / post mixing
_MHC_PTRS = dict.fromkeys(
    ("mix_ptr", "invr_ptr", "grad_mix_ptr", "grad_phi_ptr", "b_ptr", "hpre_ptr", "hpost_ptr", "hres_ptr",
     "hist_ptr", "grad_out_ptr", "grad_logits_ptr", "alpha_pre_ptr", "alpha_post_ptr", "alpha_res_ptr",
     "grad_h_ptr", "grad_hpost_ptr", "grad_hres_ptr"), "fp32",
)  # fmt: skip
_MHC_PTRS.update(dict.fromkeys(("x_ptr", "phi_ptr", "grad_x_ptr", "out_ptr", "f_ptr", "grad_f_ptr"), "bf16"))
_MHC_MM = {"N": 8192, "K": 4096, "M": 24, "stride_xn": 4096, "stride_xk": 1, "stride_phik": 24,
           "stride_phim": 1, "stride_mn": 24, "stride_mm": 1}  # fmt: skip
_add(_spec(
    "mhc_mm_norm_fwd", mhc._mhc_mm_norm_fwd_kernel, _MHC_PTRS,
    {**_MHC_MM, "eps": 1e-6, "BLOCK_N": 32, "BLOCK_K": 256, "BLOCK_M": 32, "CAST_FP32": False},
))  # fmt: skip
_add(_spec(
    "mhc_mm_norm_bwd", mhc._mhc_mm_norm_bwd_fused_kernel, _MHC_PTRS,
    {**_MHC_MM, "stride_invr": 1, "stride_gmn": 24, "stride_gmm": 1, "stride_gxn": 4096, "stride_gxk": 1,
     "stride_gpk": 24, "stride_gpm": 1, "BLOCK_N": 32, "BLOCK_K": 256, "BLOCK_M": 32, "CAST_FP32": False},
))  # fmt: skip
_HC = 4
_add(_spec(
    "mhc_sinkhorn_fwd", mhc._mhc_split_sinkhorn_fwd_kernel, _MHC_PTRS,
    {"N": 8192, "HC": _HC, "M": 24, "stride_mn": 24, "stride_mm": 1, "stride_hp_n": 4, "stride_hp_h": 1,
     "stride_hq_n": 4, "stride_hq_h": 1, "stride_hr_n": 16, "stride_hr_i": 4, "stride_hr_j": 1,
     "stride_hn": 320, "stride_ht": 16, "stride_hi": 4, "stride_hj": 1, "pre_eps": 1e-6,
     "sinkhorn_eps": 1e-6, "post_mult": 2.0, "TMAX": 20, "STORE_HIST": True}, 1,
))  # fmt: skip
_add(_spec(
    "mhc_sinkhorn_bwd", mhc._mhc_sinkhorn_bwd_hist_kernel, _MHC_PTRS,
    {"N": 8192, "HC": _HC, "stride_mn": 24, "stride_mm": 1, "stride_hn": 320, "stride_ht": 16,
     "stride_hi": 4, "stride_hj": 1, "stride_go_n": 16, "stride_go_i": 4, "stride_go_j": 1,
     "stride_gl_n": 16, "stride_gl_i": 4, "stride_gl_j": 1, "sinkhorn_eps": 1e-6, "TMAX": 20}, 1,
))  # fmt: skip
_MHC_C = {"N": 8192, "HC": _HC, "C": 1024}
_add(_spec(
    "mhc_pre_fwd", mhc._mhc_pre_fwd_kernel, _MHC_PTRS,
    {**_MHC_C, "stride_xn": 4096, "stride_xh": 1024, "stride_xc": 1, "stride_hn": 4, "stride_hh": 1,
     "stride_on": 1024, "stride_oc": 1, "BLOCK_N": 32, "BLOCK_C": 128},
))  # fmt: skip
_add(_spec(
    "mhc_post_res_fwd", mhc._mhc_post_res_fwd_kernel, _MHC_PTRS,
    {**_MHC_C, "stride_xn": 4096, "stride_xh": 1024, "stride_xc": 1, "stride_fn": 1024, "stride_fc": 1,
     "stride_hpn": 4, "stride_hph": 1, "stride_hrn": 16, "stride_hri": 4, "stride_hrj": 1,
     "stride_on": 4096, "stride_oh": 1024, "stride_oc": 1, "BLOCK_N": 32, "BLOCK_C": 128}, 4, 2,
))  # fmt: skip
