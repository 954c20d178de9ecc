/* Dense-update semantics' catch-up: rows brought over the zero-gradient steps they missed, one row at a time.
 *
 * Owns: catchup_rows, the compiled form of numerics/catchup/replay.catch_up for every rule of numerics/catchup
 * (SGD and SGD momentum with lazy_update=False, NAG, Signum, signSGD, RMSProp plain and centered, Adam with
 * lazy_update=False). Each rule's step is the float32 operations of its numpy reference (sgd_family.py,
 * adaptive.py), one by one in the same order, so the rows are bit-identical to the numpy replay and so to stock's
 * iteration (tests/test_catchup.py runs both). Per row, per missed step, per element: no pass over the whole
 * request a step, no temporaries; a row that a step leaves bit for bit as it was skips the rest of that run of
 * equal scalars (a step is a function of the row and the scalars alone).
 * Does not own: which steps a row missed or their scalars (the caller passes the key's log as runs), which rows.
 */
#include "kernels.h"

enum { RULE_SGD, RULE_SGD_MOM, RULE_NAG, RULE_SIGNUM, RULE_SIGNSGD, RULE_RMSPROP, RULE_RMSPROP_CENTERED, RULE_ADAM };

static inline int negative_zero(float x) { return x == 0.0f && signbit(x); }

/* np.clip(x, lo, hi) for lo <= hi (NaN stays NaN) */
static inline float clip_to(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

static inline uint32_t bits(float x) { uint32_t u; memcpy(&u, &x, sizeof u); return u; }

/* One step of `rule` with scalars `sc` on one row (d elements of w and of each state); whether anything changed. */
static int step_row(int64_t rule, const float *sc, int64_t d, float *w, float *s0, float *s1, float *s2)
{
    uint32_t changed = 0;
    for (int64_t j = 0; j < d; j++) {
        float x = w[j], nx;
        switch (rule) {
        case RULE_SGD:                       /* w *= 1 - lr*wd */
            nx = x * sc[0];
            break;
        case RULE_SGD_MOM: {                 /* mom = momentum*mom - (lr*wd)*w [- g0]; w += mom */
            float t = x * sc[1], m = s0[j] * sc[0];
            m = m - t;
            if (negative_zero(sc[2])) m = m - sc[2];
            changed |= bits(m) ^ bits(s0[j]);
            s0[j] = m;
            nx = x + m;
            break;
        }
        case RULE_NAG: {                     /* momentum, momentum+1, lr, wd, g0 */
            float m = s0[j] * sc[0];
            float t = x * sc[3];
            t = t + sc[4];
            t = t * sc[2];
            float u = m - t;
            u = u * sc[1];
            nx = x - m;
            nx = nx + u;
            m = m - t;
            changed |= bits(m) ^ bits(s0[j]);
            s0[j] = m;
            break;
        }
        case RULE_SIGNUM: {                  /* momentum, (1-momentum)*wd, g0, 1 - lr*wd_lh, lr */
            float t = x * sc[1], m = s0[j] * sc[0];
            m = m - t;
            if (negative_zero(sc[2])) m = m - sc[2];
            nx = x;
            if (sc[3] != 1.0f) nx = nx * sc[3];
            float sign = (float)(m > 0.0f) - (float)(m < 0.0f);
            sign = sign * sc[4];
            nx = nx + sign;
            changed |= bits(m) ^ bits(s0[j]);
            s0[j] = m;
            break;
        }
        case RULE_SIGNSGD:                   /* 1 - lr*wd, lr*sign(0) */
            nx = x;
            if (sc[0] != 1.0f) nx = nx * sc[0];
            if (negative_zero(sc[1])) nx = nx - sc[1];
            break;
        case RULE_RMSPROP:
        case RULE_RMSPROP_CENTERED: {        /* lr, wd, g0 term, clip, 1-gamma1, gamma1, eps, clip_weights[, gamma2] */
            float g = x * sc[1];
            g = g + sc[2];
            if (sc[3] >= 0.0f) g = clip_to(g, -sc[3], sc[3]);
            if (rule == RULE_RMSPROP) {
                float t = g * g;
                t = t * sc[4];
                float n = s0[j] * sc[5];
                n = t + n;
                t = n + sc[6];
                t = sqrtf(t);
                g = g / t;
                g = g * sc[0];
                nx = x - g;
                changed |= bits(n) ^ bits(s0[j]);
                s0[j] = n;
            } else {
                float t = g * sc[4];
                t = t * g;
                float n = s0[j] * sc[5];
                n = t + n;
                t = g * sc[4];
                float avg = s1[j] * sc[5];
                avg = t + avg;
                g = g * sc[0];
                t = avg * avg;
                t = n - t;
                t = t + sc[6];
                t = sqrtf(t);
                g = g / t;
                float delta = s2[j] * sc[8];
                delta = delta - g;
                nx = x + delta;
                changed |= (bits(n) ^ bits(s0[j])) | (bits(avg) ^ bits(s1[j])) | (bits(delta) ^ bits(s2[j]));
                s0[j] = n;
                s1[j] = avg;
                s2[j] = delta;
            }
            if (sc[7] >= 0.0f) nx = clip_to(nx, -sc[7], sc[7]);
            break;
        }
        case RULE_ADAM: {                    /* lr_t, wd, clip, beta1, 1-beta1, beta2, 1-beta2, eps */
            float g = x * sc[1];
            if (sc[2] >= 0.0f) g = clip_to(g, -sc[2], sc[2]);
            float t = g * sc[4];
            float mean = s0[j] * sc[3];
            mean = mean + t;
            t = g * g;
            t = t * sc[6];
            float var = s1[j] * sc[5];
            var = var + t;
            t = sqrtf(var);
            t = t + sc[7];
            g = mean * sc[0];
            g = g / t;
            nx = x - g;
            changed |= (bits(mean) ^ bits(s0[j])) | (bits(var) ^ bits(s1[j]));
            s0[j] = mean;
            s1[j] = var;
            break;
        }
        default:
            return -1;
        }
        changed |= bits(nx) ^ bits(x);
        w[j] = nx;
    }
    return changed != 0;
}

/* Rows i < n (w, s0..s2: n x d float32, C-contiguous; states a rule lacks may be NULL), each last updated at step
 * last[i], brought to step `upto` by the zero-gradient steps last[i]+1 .. upto of a log of `runs` runs (the run r
 * starts at step starts[r], ascending, and ends where the next one starts, the last at step log_last; its scalars
 * are values[r*width .. r*width+width)). The caller checks that the log holds every step. Returns the row-steps
 * applied (a step skipped at a fixed point is not counted), or -1 for an unknown rule. */
int64_t catchup_rows(int64_t rule, int64_t n, int64_t d, float *w, float *s0, float *s1, float *s2,
                     const int64_t *last, int64_t upto, int64_t runs, const int64_t *starts, const float *values,
                     int64_t width, int64_t log_last)
{
    int64_t applied = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = last[i] + 1;
        if (k > upto || runs <= 0)
            continue;
        int64_t lo = 0, hi = runs - 1;           /* the run holding step k: the last one starting at or before it */
        while (lo < hi) {
            int64_t mid = lo + (hi - lo + 1) / 2;
            if (starts[mid] <= k) lo = mid; else hi = mid - 1;
        }
        float *wr = w + i * d, *a = s0 ? s0 + i * d : NULL, *b = s1 ? s1 + i * d : NULL, *c = s2 ? s2 + i * d : NULL;
        for (int64_t r = lo; r < runs && k <= upto; r++) {
            int64_t end = r + 1 < runs ? starts[r + 1] - 1 : log_last;
            if (end > upto) end = upto;
            const float *sc = values + r * width;
            for (; k <= end; k++) {
                int changed = step_row(rule, sc, d, wr, a, b, c);
                if (changed < 0)
                    return -1;
                applied++;
                if (!changed) {                  /* a fixed point of this run's step: the rest of the run is too */
                    k = end + 1;
                    break;
                }
            }
        }
    }
    return applied;
}
