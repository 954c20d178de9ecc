/* Inner loops of the row store and of the SGD/Adam updates, called through ctypes (kernels.py builds and loads this).
 *
 * Each function replaces a chain of whole-array numpy passes, and the temporaries between them, with one loop over
 * the rows a request touches. Arrays are C-contiguous; kernels.py checks dtypes, shapes and slot ranges first.
 *
 * Float arithmetic is float32, operation by operation in the order of the numpy reference in optimizers.py (itself
 * the order of MXNet 1.9.1's kernels). Built with -ffp-contract=off and without -ffast-math, so the compiler neither
 * fuses multiply-adds nor reassociates: results are bit-identical to the numpy path (tests/test_optimizers.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MULT 0xBF58476D1CE4E5B9ULL

static inline int64_t home(uint64_t id, unsigned shift) { return (int64_t)((((id >> 31) ^ id) * MULT) >> shift); }

/* Linear-probing hash index: table[bucket] is a slot or -1, keys[slot] the row id; len(table) = mask + 1. */
#define INDEX_KERNELS(T, SUFFIX)                                                                                  \
    void index_lookup_##SUFFIX(const T *table, int64_t mask, const uint64_t *keys, const uint64_t *ids,        \
                               int64_t n, unsigned shift, int64_t *out) {                                      \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            uint64_t id = ids[i];                                                                              \
            int64_t pos = home(id, shift);                                                                     \
            for (;;) {                                                                                         \
                T slot = table[pos];                                                                           \
                if (slot < 0) { out[i] = -1; break; }                                                          \
                if (keys[slot] == id) { out[i] = slot; break; }                                                \
                pos = (pos + 1) & mask;                                                                        \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    void index_place_##SUFFIX(T *table, int64_t mask, const uint64_t *ids, int64_t n, int64_t first_slot,      \
                              unsigned shift) {                                                                \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            int64_t pos = home(ids[i], shift);                                                                 \
            while (table[pos] >= 0) pos = (pos + 1) & mask;                                                    \
            table[pos] = (T)(first_slot + i);                                                                  \
        }                                                                                                      \
    }

INDEX_KERNELS(int32_t, i32)
INDEX_KERNELS(int64_t, i64)

/* Removing rows from the index, slots kept dense (swap-with-last). del[0..k) are the slots removed (unique), holes[i]
 * and movers[i] (m pairs) say that the live row at slot movers[i] (>= n - k) moves to slot holes[i] (a removed slot
 * < n - k). First every removed slot's bucket is emptied by backward-shift deletion (the entries after it in its probe
 * run move back when their home bucket allows, so no run is broken and no tombstone is needed; keys[] of removed slots
 * are still intact while this runs), then each mover's bucket and keys[] entry follow it to its hole. */
#define INDEX_REMOVE(T, SUFFIX)                                                                                   \
    static int64_t bucket_of_##SUFFIX(const T *table, int64_t mask, const uint64_t *keys, int64_t slot,         \
                                      unsigned shift) {                                                        \
        int64_t pos = home(keys[slot], shift);                                                                 \
        while (table[pos] != (T)slot) pos = (pos + 1) & mask;                                                  \
        return pos;                                                                                            \
    }                                                                                                          \
    void index_remove_##SUFFIX(T *table, int64_t mask, uint64_t *keys, const int64_t *del, int64_t k,         \
                               const int64_t *holes, const int64_t *movers, int64_t m, unsigned shift) {       \
        for (int64_t i = 0; i < k; i++) {                                                                      \
            int64_t hole = bucket_of_##SUFFIX(table, mask, keys, del[i], shift), j = hole;                     \
            for (;;) {                                                                                         \
                j = (j + 1) & mask;                                                                            \
                T slot = table[j];                                                                             \
                if (slot < 0) break;                                                                           \
                int64_t h = home(keys[slot], shift);                                                           \
                /* the entry at j stays unless its home lies outside the cyclic range (hole, j] */             \
                int stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);                           \
                if (!stays) { table[hole] = slot; hole = j; }                                                  \
            }                                                                                                  \
            table[hole] = -1;                                                                                  \
        }                                                                                                      \
        for (int64_t i = 0; i < m; i++) {                                                                      \
            table[bucket_of_##SUFFIX(table, mask, keys, movers[i], shift)] = (T)holes[i];                      \
            keys[holes[i]] = keys[movers[i]];                                                                  \
        }                                                                                                      \
    }

INDEX_REMOVE(int32_t, i32)
INDEX_REMOVE(int64_t, i64)

/* Union of two sorted unique id lists with their rows (cols floats each); rows in both are summed as a + b. As the
 * numpy merge did (zeros, a assigned, b added): rows only in a are copied, rows only in b are 0 + b (-0.0 -> +0.0).
 * ids/vals have room for na + nb rows; returns the number written. */
int64_t merge_rows_f32(const int64_t *ids_a, const float *a, int64_t na, const int64_t *ids_b, const float *b,
                       int64_t nb, int64_t cols, int64_t *ids, float *vals) {
    int64_t i = 0, j = 0, k = 0;
    size_t row = (size_t)cols * sizeof(float);
    while (i < na || j < nb) {
        if (j == nb || (i < na && ids_a[i] < ids_b[j])) {
            ids[k] = ids_a[i];
            memcpy(vals + k * cols, a + i * cols, row);
            i++;
        } else if (i == na || ids_b[j] < ids_a[i]) {
            ids[k] = ids_b[j];
            for (int64_t c = 0; c < cols; c++) vals[k * cols + c] = 0.0f + b[j * cols + c];
            j++;
        } else {
            ids[k] = ids_a[i];
            for (int64_t c = 0; c < cols; c++) vals[k * cols + c] = a[i * cols + c] + b[j * cols + c];
            i++;
            j++;
        }
        k++;
    }
    return k;
}

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
        int64_t base = slots[i] * cols;
        float *w = weight + base, *mn = mean + base, *vr = var + base;
        const float *g = grad + i * cols;
        if (clip >= 0 && square_first) adam_row(w, mn, vr, g, cols, lr, wd, beta1, beta2, b1, b2, eps, rescale, clip, 1, 1);
        else if (clip >= 0) adam_row(w, mn, vr, g, cols, lr, wd, beta1, beta2, b1, b2, eps, rescale, clip, 1, 0);
        else if (square_first) adam_row(w, mn, vr, g, cols, lr, wd, beta1, beta2, b1, b2, eps, rescale, clip, 0, 1);
        else adam_row(w, mn, vr, g, cols, lr, wd, beta1, beta2, b1, b2, eps, rescale, clip, 0, 0);
    }
}
