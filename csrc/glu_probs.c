/*
 * glu_probs.c: the expert activation (GLU-aware) and the router-probs multiply in one pass, CPU.
 *
 * All the numerics live in glu_probs_math.h; this file only walks the rows. The one thing to know
 * is the backward's grad_probs order: each row's sum is split into 32 lanes of chunks and folded
 * by the warp butterfly, exactly as the CUDA kernel's one warp per row does, so the CPU and CUDA
 * sums are the same bits whatever the thread count.
 */
#include "glu_probs_math.h"

moe_status_t moe_glu_probs_fwd(void *h, const void *a, const void *probs, int64_t num_rows,
                               int64_t ffn, moe_dtype_t dtype, moe_dtype_t probs_dtype,
                               const moe_glu_probs_params_t *params, void *workspace,
                               size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(moe_gp_check_args(h, a, num_rows, ffn, dtype, probs, probs_dtype, params));
    const moe_gp_ctx_t c = moe_gp_ctx_make(params, dtype, probs != NULL, probs_dtype);
    const int64_t width = c.gated ? 2 * ffn : ffn; /* a's row length */

#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < num_rows; ++r) {
        const double p = c.has_probs ? moe_load(probs, probs_dtype, r) : 1.0;
        for (int64_t f = 0; f < ffn; ++f) {
            const double g = moe_load(a, dtype, r * width + moe_gp_gate_col(&c, f));
            const double l = c.gated ? moe_load(a, dtype, r * width + moe_gp_lin_col(&c, ffn, f))
                                     : 0.0;
            moe_store(h, dtype, r * ffn + f, moe_gp_elem_fwd(&c, g, l, p));
        }
    }
    return MOE_OK;
}

moe_status_t moe_glu_probs_bwd(void *grad_a, void *grad_probs, void *h, const void *grad_h,
                               const void *a,
                               const void *probs, int64_t num_rows, int64_t ffn, moe_dtype_t dtype,
                               moe_dtype_t probs_dtype, const moe_glu_probs_params_t *params,
                               void *workspace, size_t workspace_bytes, void *stream) {
    (void)workspace, (void)workspace_bytes, (void)stream;
    moe_clear_error();
    MOE_TRY(moe_gp_check_args(grad_a, a, num_rows, ffn, dtype, probs, probs_dtype, params));
    MOE_CHECK(num_rows == 0 || grad_h, "grad_h must not be NULL");
    MOE_CHECK(!grad_probs || probs, "grad_probs needs probs (there is no multiply without them)");
    const moe_gp_ctx_t c = moe_gp_ctx_make(params, dtype, probs != NULL, probs_dtype);
    const int64_t width = c.gated ? 2 * ffn : ffn;
    const int64_t chunk = moe_gp_chunk(dtype, ffn);

#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < num_rows; ++r) {
        const double p = c.has_probs ? moe_load(probs, probs_dtype, r) : 1.0;
        double lane[MOE_GP_LANES];
        for (int i = 0; i < MOE_GP_LANES; ++i) lane[i] = 0.0;
        for (int64_t f = 0; f < ffn; ++f) {
            const int64_t gc = moe_gp_gate_col(&c, f), lc = moe_gp_lin_col(&c, ffn, f);
            const double dy = moe_load(grad_h, dtype, r * ffn + f);
            const double g = moe_load(a, dtype, r * width + gc);
            const double l = c.gated ? moe_load(a, dtype, r * width + lc) : 0.0;
            double gg, gl, term, hv;
            /* in place (grad_a = a, h = grad_h): this element was read above */
            moe_gp_elem_bwd(&c, dy, g, l, p, &gg, &gl, &term, h ? &hv : NULL);
            moe_store(grad_a, dtype, r * width + gc, gg);
            if (c.gated) moe_store(grad_a, dtype, r * width + lc, gl);
            if (h) moe_store(h, dtype, r * ffn + f, hv);
            lane[(f / chunk) % MOE_GP_LANES] += term;
        }
        if (grad_probs) {
            for (int off = MOE_GP_LANES / 2; off >= 1; off /= 2) {
                double next[MOE_GP_LANES];
                for (int i = 0; i < MOE_GP_LANES; ++i) next[i] = lane[i] + lane[i ^ off];
                for (int i = 0; i < MOE_GP_LANES; ++i) lane[i] = next[i];
            }
            moe_store(grad_probs, probs_dtype, r, moe_gp_grad_probs_round(&c, lane[0]));
        }
    }
    return MOE_OK;
}
