/* The optimizer steps on table rows in place (numerics/optimizers.py's SGD and Adam; protocol/_fast_updates.c calls
 * the same functions by address): MXNet 1.9.1's sgd_update, sgd_mom_update, multi_sgd_update and adam_update.
 *
 * Owns: the float32 arithmetic of one step of every row a request touches, operation by operation in MXNet's order
 * (-ffp-contract=off: no fused multiply-add). Does not own: the hyper-parameters' schedule or parsing
 * (optimizers.py), the arrays' checks (kernels.py).
 */
#include "kernels.h"

/* The update kernels loop over rows; each row is a short loop the compiler vectorises. Flags that decide the formula
 * (clipping, momentum, ...) are compile-time constants in each specialisation (ALWAYS_INLINE + literal arguments),
 * so the inner loops have no branches. Vectorising elementwise float32 code changes no result. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* mshadow_op::clip: x > b ? b : (x < -b ? -b : x) (NaN passes through) */
ALWAYS_INLINE float clip_to(float x, float bound) { return x > bound ? bound : (x < -bound ? -bound : x); }

/* lr * clip(rescale * g), or (lr * rescale) * g without clipping */
ALWAYS_INLINE float step_term(float g, float lr, float rescale, float clip, float lr_rescale, const int clipped) {
    return clipped ? lr * clip_to(rescale * g, clip) : lr_rescale * g;
}

ALWAYS_INLINE void sgd_row(float *restrict w, const float *restrict g, int64_t cols, float decay, float lr,
                           float rescale, float clip, float lr_rescale, const int clipped) {
    for (int64_t c = 0; c < cols; c++) w[c] = decay * w[c] - step_term(g[c], lr, rescale, clip, lr_rescale, clipped);
}

/* SGD without momentum (sgd_update, SGDDnsRspKernel): w = (1 - lr wd) w - step. Row slots[i] gets grad row i. */
void sgd_rows(float *weight, const int64_t *slots, int64_t n, const float *grad, int64_t cols, float lr, float wd,
              float rescale, float clip) {
    float decay = 1.0f - lr * wd, lr_rescale = lr * rescale;
    for (int64_t i = 0; i < n; i++) {
        PREFETCH_ROW(weight, slots, i, n, cols);
        float *w = weight + slots[i] * cols;
        const float *g = grad + i * cols;
        if (clip >= 0) sgd_row(w, g, cols, decay, lr, rescale, clip, lr_rescale, 1);
        else sgd_row(w, g, cols, decay, lr, rescale, clip, lr_rescale, 0);
    }
}

ALWAYS_INLINE void sgd_mom_row(float *restrict w, float *restrict m, const float *restrict g, int64_t cols,
                               float lr_wd, float lr, float rescale, float clip, float lr_rescale, float momentum,
                               const int has_mom, const int clipped) {
    for (int64_t c = 0; c < cols; c++) {
        float v = has_mom ? momentum * m[c] : 0.0f;
        v = v - lr_wd * w[c];
        v = v - step_term(g[c], lr, rescale, clip, lr_rescale, clipped);
        if (has_mom) m[c] = v;
        w[c] = w[c] + v;
    }
}

/* SGD with momentum (SGDMomKernel / MultiSGD[Mom]Kernel): mom = m mom - lr wd w - step; w = w + mom. With mom NULL
 * (multi_sgd_update: dense SGD without momentum) the previous momentum is 0 and nothing is stored. */
void sgd_mom_rows(float *weight, float *mom, const int64_t *slots, int64_t n, const float *grad, int64_t cols,
                  float lr, float wd, float rescale, float clip, float momentum) {
    float lr_wd = lr * wd, lr_rescale = lr * rescale;
    for (int64_t i = 0; i < n; i++) {
        PREFETCH_ROW(weight, slots, i, n, cols);
        if (mom) PREFETCH_ROW(mom, slots, i, n, cols);
        float *w = weight + slots[i] * cols, *m = mom ? mom + slots[i] * cols : 0;
        const float *g = grad + i * cols;
        if (m && clip >= 0) sgd_mom_row(w, m, g, cols, lr_wd, lr, rescale, clip, lr_rescale, momentum, 1, 1);
        else if (m) sgd_mom_row(w, m, g, cols, lr_wd, lr, rescale, clip, lr_rescale, momentum, 1, 0);
        else if (clip >= 0) sgd_mom_row(w, m, g, cols, lr_wd, lr, rescale, clip, lr_rescale, momentum, 0, 1);
        else sgd_mom_row(w, m, g, cols, lr_wd, lr, rescale, clip, lr_rescale, momentum, 0, 0);
    }
}

ALWAYS_INLINE void adam_row(float *restrict w, float *restrict mn, float *restrict vr, const float *restrict gr,
                            int64_t cols, float lr, float wd, float beta1, float beta2, float one_m_beta1,
                            float one_m_beta2, float eps, float rescale, float clip, const int clipped,
                            const int square_first) {
    for (int64_t c = 0; c < cols; c++) {
        float g = gr[c] * rescale + w[c] * wd;
        if (clipped) g = clip_to(g, clip);
        float m = beta1 * mn[c] + one_m_beta1 * g;
        float v = square_first ? beta2 * vr[c] + one_m_beta2 * (g * g) : beta2 * vr[c] + (one_m_beta2 * g) * g;
        mn[c] = m;
        vr[c] = v;
        w[c] = w[c] - (lr * m) / (sqrtf(v) + eps);
    }
}

/* Adam (AdamUpdateKernel / AdamDnsRspDnsKernel). square_first: var term (1 - b2) (g g), else ((1 - b2) g) g. */
void adam_rows(float *weight, float *mean, float *var, const int64_t *slots, int64_t n, const float *grad,
               int64_t cols, float lr, float wd, float beta1, float beta2, float eps, float rescale, float clip,
               int square_first) {
    float b1 = 1.0f - beta1, b2 = 1.0f - beta2;
    for (int64_t i = 0; i < n; i++) {
        PREFETCH_ROW(weight, slots, i, n, cols);
        PREFETCH_ROW(mean, slots, i, n, cols);
        PREFETCH_ROW(var, slots, i, n, cols);
        int64_t base = slots[i] * cols;
        float *w = weight + base, *mn = mean + base, *vr = var + base;
        const float *g = grad + i * cols;
        if (clip >= 0 && square_first) adam_row(w, mn, vr, g, cols, lr, wd, beta1, beta2, b1, b2, eps, rescale, clip, 1, 1);
        else if (clip >= 0) adam_row(w, mn, vr, g, cols, lr, wd, beta1, beta2, b1, b2, eps, rescale, clip, 1, 0);
        else if (square_first) adam_row(w, mn, vr, g, cols, lr, wd, beta1, beta2, b1, b2, eps, rescale, clip, 0, 1);
        else adam_row(w, mn, vr, g, cols, lr, wd, beta1, beta2, b1, b2, eps, rescale, clip, 0, 0);
    }
}
