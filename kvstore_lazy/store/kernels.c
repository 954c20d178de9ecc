/* Inner loops of the row store and of the SGD/Adam updates, called through ctypes (setup.py builds it into
 * _kernels.so at install time; kernels.py loads it).
 *
 * Each function replaces a chain of whole-array numpy passes, and the temporaries between them, with one loop over
 * the rows a request touches. Arrays are C-contiguous; kernels.py checks dtypes, shapes and slot ranges first.
 *
 * Float arithmetic is float32, operation by operation in the order of the numpy reference in optimizers.py (itself
 * the order of MXNet 1.9.1's kernels). Built with -ffp-contract=off and without -ffast-math, so the compiler neither
 * fuses multiply-adds nor reassociates: results are bit-identical to the numpy path (tests/test_optimizers.py).
 */
#define _POSIX_C_SOURCE 200809L  /* pread under -std=c99 */
#define _DEFAULT_SOURCE          /* syscall, MAP_POPULATE (the io_uring reads) */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#define HAVE_URING 1
#endif

#ifndef KERNELS_DIGEST
#error "build with -DKERNELS_DIGEST=\"<sha256 of this file>\" (setup.py does)"
#endif

/* The SHA-256 of the source this library was built from: kernels.py refuses a library older than kernels.c. */
const char *kernels_digest(void) { return KERNELS_DIGEST; }

#define MULT 0xBF58476D1CE4E5B9ULL

static inline int64_t home(uint64_t id, unsigned shift) { return (int64_t)((((id >> 31) ^ id) * MULT) >> shift); }

/* The rows and buckets a kernel touches lie at random places of tables larger than the caches, each a miss: a
 * kernel asks for the ones PREFETCH iterations ahead (a row's first cache line: the hardware prefetcher follows a
 * longer row), so the misses overlap instead of following one another. A prefetch changes no result. */
#define PREFETCH 8
#define PREFETCH_ROW(base, slots, i, n, cols) \
    do { if ((i) + PREFETCH < (n)) __builtin_prefetch((base) + (slots)[(i) + PREFETCH] * (cols), 1); } while (0)

/* Linear-probing hash index: table[bucket] is a slot or -1, keys[slot] the row id; len(table) = mask + 1. A lookup
 * asks for the home bucket of the id 2 PREFETCH ahead, and for the row id of the slot in the home bucket of the one
 * PREFETCH ahead (by then that bucket is in the cache). */
#define INDEX_KERNELS(T, SUFFIX)                                                                                  \
    void index_lookup_##SUFFIX(const T *table, int64_t mask, const uint64_t *keys, const uint64_t *ids,        \
                               int64_t n, unsigned shift, int64_t *out) {                                      \
        for (int64_t i = 0; i < n; i++) {                                                                      \
            if (i + 2 * PREFETCH < n) __builtin_prefetch(table + home(ids[i + 2 * PREFETCH], shift), 0);      \
            if (i + PREFETCH < n) {                                                                            \
                T ahead = table[home(ids[i + PREFETCH], shift)];                                               \
                if (ahead >= 0) __builtin_prefetch(keys + ahead, 0);                                           \
            }                                                                                                  \
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
            if (i + PREFETCH < n) __builtin_prefetch(table + home(ids[i + PREFETCH], shift), 1);               \
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
            if (i + 2 * PREFETCH < k) __builtin_prefetch(keys + del[i + 2 * PREFETCH], 0);                      \
            if (i + PREFETCH < k) __builtin_prefetch(table + home(keys[del[i + PREFETCH]], shift), 1);          \
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
            if (i + PREFETCH < m) {                                                                            \
                __builtin_prefetch(table + home(keys[movers[i + PREFETCH]], shift), 1);                        \
                __builtin_prefetch(keys + holes[i + PREFETCH], 1);                                             \
            }                                                                                                  \
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

/* Box-Muller for the Normal initializers (initializers.NormalRows), with log, cos and sin of our own made of IEEE
 * basic operations only (+ - * / and sqrt, which every IEEE platform rounds alike; nothing from libm or numpy, whose
 * SIMD loops differ between numpy versions and CPUs: numpy 1.23 and 2.x give different float64 np.log/np.cos/np.sin
 * for about half of all arguments on AVX-512). So a lazy row's initial value is the same on every server whatever
 * numpy it runs. Accurate to about 1 ulp (tests/test_kernels.py measures it against Python's math module). */

#define LN2_HI 0x1.62e42fefa4000p-1     /* ln 2 in 40 bits (e * LN2_HI is exact), and the rest */
#define LN2_LO -0x1.8432a1b0e2634p-43
#define PIO2_1 0x1.921fb54400000p+0     /* pi/2 in three parts, 33 + 33 + 53 bits (n * PIO2_1, n * PIO2_2 exact) */
#define PIO2_2 0x1.0b4611a600000p-34
#define PIO2_3 0x1.3198a2e037073p-69

/* ln x for normal x in (0, 1]: x = m 2^e with m in [sqrt(1/2), sqrt(2)), f = m - 1, s = f / (2 + f), and
 * ln(1 + f) = 2 atanh(s) = f - (f^2/2 - s (f^2/2 + R)), R = sum_k 2 s^2k / (2k + 1) (|s| < 0.1716: 12 terms). */
static double log_unit(double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int e = (int)((bits >> 52) & 0x7ff) - 1022;
    bits = (bits & 0x000fffffffffffffULL) | 0x3fe0000000000000ULL;   /* m in [1/2, 1) */
    double m;
    memcpy(&m, &bits, sizeof m);
    if (m < 0x1.6a09e667f3bcdp-1) { m *= 2.0; e -= 1; }
    double f = m - 1.0, s = f / (2.0 + f), z = s * s, hfsq = 0.5 * f * f, r = 2.0 / 25.0;
    for (int k = 11; k >= 1; k--) r = 2.0 / (2 * k + 1) + z * r;
    r *= z;
    return e * LN2_HI - ((hfsq - (s * (hfsq + r) + e * LN2_LO)) - f);
}

/* 1/(2j+1)! and 1/(2j)! for j = 1..10 (k! is exact in a double up to 22!, so each is one correctly rounded division) */
static const double INV_ODD_FACT[] = {1.0 / 6.0, 1.0 / 120.0, 1.0 / 5040.0, 1.0 / 362880.0, 1.0 / 39916800.0,
                                      1.0 / 6227020800.0, 1.0 / 1307674368000.0, 1.0 / 355687428096000.0,
                                      1.0 / 121645100408832000.0, 1.0 / 51090942171709440000.0};
static const double INV_EVEN_FACT[] = {1.0 / 2.0, 1.0 / 24.0, 1.0 / 720.0, 1.0 / 40320.0, 1.0 / 3628800.0,
                                       1.0 / 479001600.0, 1.0 / 87178291200.0, 1.0 / 20922789888000.0,
                                       1.0 / 6402373705728000.0, 1.0 / 2432902008176640000.0};

/* sin and cos of theta in [0, 2 pi]: theta = n pi/2 + r with |r| <= pi/4 (n * PIO2_1 exact, theta - n * PIO2_1
 * exact by Sterbenz), the Taylor series of sin r to r^21 and of cos r to r^20, then the quadrant n. */
static void sincos_turn(double theta, double *sin_out, double *cos_out) {
    int n = (int)(theta * 0x1.45f306dc9c883p-1 + 0.5);            /* nearest multiple of pi/2: theta * 2/pi */
    double r = ((theta - n * PIO2_1) - n * PIO2_2) - n * PIO2_3, z = r * r;
    double ps = INV_ODD_FACT[9], pc = INV_EVEN_FACT[9];
    for (int j = 8; j >= 1; j--) {
        ps = INV_ODD_FACT[j] - z * ps;     /* 1/5! - z/7! + ... */
        pc = INV_EVEN_FACT[j] - z * pc;    /* 1/4! - z/6! + ... */
    }
    double s = r - r * z * (INV_ODD_FACT[0] - z * ps);   /* r - r^3/3! + r^5/5! - ... */
    double c = 1.0 - (0.5 * z - z * z * pc);             /* 1 - r^2/2! + r^4/4! - ... */
    switch (n & 3) {
        case 0: *sin_out = s; *cos_out = c; break;
        case 1: *sin_out = c; *cos_out = -s; break;
        case 2: *sin_out = -s; *cos_out = -c; break;
        default: *sin_out = -c; *cos_out = s; break;
    }
}

/* out[2i] = rad cos(theta), out[2i + 1] = rad sin(theta) with rad = sqrt(-2 ln(1 - u[2i])), theta = u[2i+1] two_pi,
 * for uniforms u in [0, 1) (1 - u is exact and in (0, 1]): the order of operations of the numpy expression before. */
void box_muller_f64(const double *u, int64_t pairs, double two_pi, double *out) {
    for (int64_t i = 0; i < pairs; i++) {
        double rad = sqrt(-2.0 * log_unit(1.0 - u[2 * i])), s, c;
        sincos_turn(u[2 * i + 1] * two_pi, &s, &c);
        out[2 * i] = rad * c;
        out[2 * i + 1] = rad * s;
    }
}

/* The two functions alone, for the accuracy tests. */
void log_unit_f64(const double *x, int64_t n, double *out) {
    for (int64_t i = 0; i < n; i++) out[i] = log_unit(x[i]);
}

void sincos_f64(const double *theta, int64_t n, double *sin_out, double *cos_out) {
    for (int64_t i = 0; i < n; i++) sincos_turn(theta[i], &sin_out[i], &cos_out[i]);
}

/* `want` bytes at `offset` of `fd` into `out`, from byte `done` on (what a read already gave); 0, an errno, or -1
 * if the file ends first (with the byte reached in *reached). */
static int64_t read_rest(int fd, char *out, int64_t offset, int64_t want, int64_t done, int64_t *reached) {
    while (done < want) {
        ssize_t got = pread(fd, out + done, (size_t)(want - done), (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            *reached = done;
            return errno;
        }
        if (got == 0) { *reached = done; return -1; }
        done += got;
    }
    return 0;
}

/* read_rest's counterpart for writes: `want` bytes of `buf` to `offset` of `fd`, from byte `done` on; 0 or an
 * errno (a write that makes no progress is EIO), with the byte reached in *reached. */
static int64_t write_rest(int fd, const char *buf, int64_t offset, int64_t want, int64_t done, int64_t *reached) {
    while (done < want) {
        ssize_t put = pwrite(fd, buf + done, (size_t)(want - done), (off_t)(offset + done));
        if (put < 0) {
            if (errno == EINTR) continue;
            *reached = done;
            return errno;
        }
        if (put == 0) { *reached = done; return EIO; }
        done += put;
    }
    return 0;
}

static int64_t rest(int write, int fd, char *buf, int64_t offset, int64_t want, int64_t done, int64_t *reached) {
    return write ? write_rest(fd, buf, offset, want, done, reached) : read_rest(fd, buf, offset, want, done, reached);
}

/* The end of the run of rows from i on that are adjacent in one file (the caller sorts by file and offset). */
static int64_t run_end(const int32_t *fds, const int64_t *offsets, int64_t i, int64_t n, int64_t size, int64_t max) {
    int64_t j = i + 1;
    while (j < n && j - i < max && fds[j] == fds[i] && offsets[j] == offsets[j - 1] + size) j++;
    return j;
}

static int64_t pio_loop(const int32_t *fds, const int64_t *offsets, int64_t n, int64_t size, char *out,
                        int64_t *failed, int write) {
    for (int64_t i = 0, j; i < n; i = j) {
        j = run_end(fds, offsets, i, n, size, INT64_MAX);
        int64_t reached = 0, err = rest(write, fds[i], out + i * size, offsets[i], (j - i) * size, 0, &reached);
        if (err) { *failed = i + reached / size; return err; }
    }
    return 0;
}

#ifdef HAVE_URING
/* An io_uring per thread (ring_of_thread: nothing shared by threads). The reads of a batch go to the kernel a ring
 * at a time in one io_uring_enter each instead of one pread system call a record; page-cache hits complete inline,
 * misses run in the kernel's workers in parallel. */
#define RING_ENTRIES 256u
#define RUN_BITS 20
struct ring {
    int fd;
    unsigned entries, *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqes_len;
};

static void ring_close(struct ring *r) {
    if (r->sqes) munmap(r->sqes, r->sqes_len);
    if (r->cq_map && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_len);
    if (r->sq_map) munmap(r->sq_map, r->sq_len);
    close(r->fd);
}

static int ring_open(struct ring *r) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    memset(r, 0, sizeof *r);
    r->fd = (int)syscall(__NR_io_uring_setup, RING_ENTRIES, &p);
    if (r->fd < 0) return -1;                      /* no io_uring here (old kernel, seccomp, disabled): pread */
    r->entries = p.sq_entries;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) r->sq_len = r->cq_len = r->sq_len > r->cq_len ? r->sq_len : r->cq_len;
    void *sq = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) { ring_close(r); return -1; }
    r->sq_map = sq;
    void *cq = single ? sq : mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                                  IORING_OFF_CQ_RING);
    if (cq == MAP_FAILED) { ring_close(r); return -1; }
    r->cq_map = cq;
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    void *sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (sqes == MAP_FAILED) { ring_close(r); return -1; }
    r->sqes = sqes;
    r->sq_head = (unsigned *)((char *)sq + p.sq_off.head);
    r->sq_tail = (unsigned *)((char *)sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)((char *)sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)((char *)sq + p.sq_off.array);
    r->cq_head = (unsigned *)((char *)cq + p.cq_off.head);
    r->cq_tail = (unsigned *)((char *)cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)((char *)cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)((char *)cq + p.cq_off.cqes);
    return 0;
}

/* pio_loop through a ring; -2 if no ring could be set up (the caller falls back). Every read submitted is
 * reaped before it returns, also after a failure (the lowest failing row is reported, as pio_loop would). */
/* Each thread's ring, set up by its first batch and kept (setting one up costs ~50 us, a batch of reads a few
 * ms): empty between calls (every read is reaped before a call returns), dropped after any failure, and set up
 * anew in a forked child (pid), which must not share its parent's ring. A thread that ends leaves its ring open
 * (one fd and three small mappings): the server reads from its main thread; the pread threads use no ring. */
static __thread struct ring thread_ring;
static __thread pid_t thread_ring_pid;

static struct ring *ring_of_thread(void) {
    pid_t pid = getpid();
    if (thread_ring_pid != pid) {
        if (ring_open(&thread_ring)) return NULL;
        thread_ring_pid = pid;
    }
    return &thread_ring;
}

static int64_t uring_loop(const int32_t *fds, const int64_t *offsets, int64_t n, int64_t size, char *out,
                          int64_t *failed, int write) {
    struct ring *kept = ring_of_thread();
    if (!kept) return -2;
    struct ring r = *kept;
    int64_t i = 0, err = 0, bad = INT64_MAX, max_run = ((int64_t)1 << RUN_BITS) - 1;
    if (max_run * size > ((int64_t)1 << 30)) max_run = size < ((int64_t)1 << 30) ? ((int64_t)1 << 30) / size : 1;
    unsigned inflight = 0, unsubmitted = 0;
    int ring_failed = 0;
    while ((!err && (i < n || unsubmitted)) || inflight) {
        unsigned tail = *r.sq_tail, queued = 0;
        while (i < n && !err && inflight + unsubmitted + queued < r.entries) {
            int64_t j = run_end(fds, offsets, i, n, size, max_run);
            unsigned idx = tail & *r.sq_mask;
            struct io_uring_sqe *e = &r.sqes[idx];
            memset(e, 0, sizeof *e);
            e->opcode = write ? IORING_OP_WRITE : IORING_OP_READ;
            e->fd = fds[i];
            e->off = (uint64_t)offsets[i];
            e->addr = (uint64_t)(uintptr_t)(out + i * size);
            e->len = (uint32_t)((j - i) * size);
            e->user_data = ((uint64_t)i << RUN_BITS) | (uint64_t)(j - i);
            r.sq_array[idx] = idx;
            tail++, queued++, i = j;
        }
        __atomic_store_n(r.sq_tail, tail, __ATOMIC_RELEASE);
        unsubmitted += queued;
        long got = syscall(__NR_io_uring_enter, r.fd, unsubmitted, inflight + unsubmitted ? 1u : 0u,
                           IORING_ENTER_GETEVENTS, NULL, 0);
        if (got < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EBUSY) continue;
            /* the ring itself failed (not a read): report it at the next row not read; wait once more for what
             * is in flight (the kernel must not write into `out` after this returns), then stop */
            if (!err || i < bad) bad = i;
            err = errno;
            if (!inflight || ring_failed++) break;
            got = 0;
        }
        unsubmitted -= (unsigned)got, inflight += (unsigned)got;
        unsigned head = *r.cq_head, end = __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE);
        for (; head != end; head++, inflight--) {
            struct io_uring_cqe *c = &r.cqes[head & *r.cq_mask];
            int64_t row = (int64_t)(c->user_data >> RUN_BITS), cnt = (int64_t)(c->user_data & ((1u << RUN_BITS) - 1));
            int64_t want = cnt * size, res = c->res, reached = 0, e;
            /* a failed read (or one this kernel's ring cannot do: IORING_OP_READ is 5.6+) is done again with
             * pread, which gives the error if there is one; a short one is finished by pread */
            e = rest(write, fds[row], out + row * size, offsets[row], want, res < 0 ? 0 : res, &reached);
            if (e && row + reached / size < bad) { bad = row + reached / size; err = e; }
        }
        __atomic_store_n(r.cq_head, head, __ATOMIC_RELEASE);
    }
    if (err || unsubmitted) {          /* the ring may hold what a failed call left: set up a new one next time */
        ring_close(kept);
        thread_ring_pid = 0;
    }
    if (err) *failed = bad;
    return err;
}
#endif

/* 1 if an io_uring can be set up here (pread_records then uses one), else 0. */
int64_t uring_available(void) {
#ifdef HAVE_URING
    struct ring r;
    if (ring_open(&r)) return 0;
    ring_close(&r);
    return 1;
#else
    return 0;
#endif
}

/* Records of a disk segment store (segments.py): row i is `size` bytes at `offsets[i]` of file `fds[i]`, read into
 * out + i * size. A run of rows adjacent in one file (offsets[i + 1] == offsets[i] + size: the caller sorts by file
 * and offset) is one read. With `ring` and io_uring available, the reads go through an io_uring (one system call a
 * ring of reads), else one pread each. Returns 0; or the errno of the first failed read (-1 for a short read: a
 * truncated file), in *failed the row where it failed. Called through ctypes, which releases the GIL: a thread pool
 * reads parts in parallel. */
static int64_t pio_records(const int32_t *fds, const int64_t *offsets, int64_t n, int64_t size, char *buf,
                           int64_t *failed, int64_t ring, int write) {
#ifdef HAVE_URING
    if (ring && n > 1) {
        int64_t err = uring_loop(fds, offsets, n, size, buf, failed, write);
        if (err != -2) return err;
    }
#else
    (void)ring;
#endif
    return pio_loop(fds, offsets, n, size, buf, failed, write);
}

int64_t pread_records(const int32_t *fds, const int64_t *offsets, int64_t n, int64_t size, char *out,
                      int64_t *failed, int64_t ring) {
    return pio_records(fds, offsets, n, size, out, failed, ring, 0);
}

/* pread_records the other way: row i of `in` (`size` bytes) written to `offsets[i]` of `fds[i]` (in place: the
 * disk tier's write-back of records it updated where they are), adjacent rows one write, through the ring where
 * there is one. Returns 0, or the errno of the first failed write (*failed: its row). */
int64_t pwrite_records(const int32_t *fds, const int64_t *offsets, int64_t n, int64_t size, char *in,
                       int64_t *failed, int64_t ring) {
    return pio_records(fds, offsets, n, size, in, failed, ring, 1);
}

/* The check of each of n records of `nwords` 32-bit words (segments.py): a position-weighted sum of the words
 * (mult[k] per word, mod 2^64), the record's location mixed in, folded to 32 bits. Same arithmetic as
 * segments._checks_numpy. */
void record_checks(const uint32_t *words, int64_t n, int64_t nwords, const uint64_t *mult, const uint32_t *locs,
                   uint32_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *w = words + i * nwords;
        uint64_t t = 0;
        for (int64_t k = 0; k < nwords; k++) t += (uint64_t)w[k] * mult[k];
        t ^= ((uint64_t)locs[i] + 1) * 0x9E3779B97F4A7C15ULL;
        t ^= t >> 29;
        t *= 0xBF58476D1CE4E5B9ULL;
        t ^= t >> 32;
        out[i] = (uint32_t)t;
    }
}

/* The same check written into each record's own check word (word `at`): sealing records before they are written. */
void record_seal(uint32_t *words, int64_t n, int64_t nwords, const uint64_t *mult, const uint32_t *locs, int64_t at) {
    for (int64_t i = 0; i < n; i++) record_checks(words + i * nwords, 1, nwords, mult, locs + i, words + i * nwords + at);
}

/* Moving whole rows between row arrays and fixed-size records (the disk tier's demote and promote, tier.py): field
 * f of a record is bytes [off[f], off[f] + bytes[f]) of it, and the row at slot s of array f is bytes[f] bytes at
 * arrays[f] + s * bytes[f]. kernels.py checks every slot against every array's length and every field against the
 * record's size first. */

/* Every cache line of the row at `slot` of each of the nf arrays (rows of a few cache lines: a record's fields). */
static inline void prefetch_fields(int64_t slot, int64_t nf, const uint64_t *arrays, const int64_t *bytes,
                                   int write) {
    for (int64_t f = 0; f < nf; f++) {
        const char *row = (const char *)(uintptr_t)arrays[f] + slot * bytes[f];
        for (int64_t b = 0; b < bytes[f]; b += 64) {
            if (write) __builtin_prefetch(row + b, 1);
            else __builtin_prefetch(row + b, 0);
        }
    }
}

/* Record i = the fields of the rows at slots[i], everything else in it (check word, padding) zero. */
void gather_fields(const int64_t *slots, int64_t n, int64_t nf, const uint64_t *arrays, const int64_t *bytes,
                   const int64_t *off, char *records, int64_t stride) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) prefetch_fields(slots[i + PREFETCH], nf, arrays, bytes, 0);
        char *rec = records + i * stride;
        memset(rec, 0, (size_t)stride);
        for (int64_t f = 0; f < nf; f++)
            memcpy(rec + off[f], (const char *)(uintptr_t)arrays[f] + slots[i] * bytes[f], (size_t)bytes[f]);
    }
}

/* The rows at slots[i] = the fields of record i. */
void scatter_fields(const int64_t *slots, int64_t n, int64_t nf, const uint64_t *arrays, const int64_t *bytes,
                    const int64_t *off, const char *records, int64_t stride) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) prefetch_fields(slots[i + PREFETCH], nf, arrays, bytes, 1);
        const char *rec = records + i * stride;
        for (int64_t f = 0; f < nf; f++)
            memcpy((char *)(uintptr_t)arrays[f] + slots[i] * bytes[f], rec + off[f], (size_t)bytes[f]);
    }
}

/* Row dst[i] of an array of rows of `row_bytes` = row src[i] (a table's removal refilling its holes; no row is both
 * a source and a destination). */
void move_rows(char *base, int64_t row_bytes, const int64_t *dst, const int64_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) {
            for (int64_t b = 0; b < row_bytes; b += 64) {
                __builtin_prefetch(base + src[i + PREFETCH] * row_bytes + b, 0);
                __builtin_prefetch(base + dst[i + PREFETCH] * row_bytes + b, 1);
            }
        }
        memcpy(base + dst[i] * row_bytes, base + src[i] * row_bytes, (size_t)row_bytes);
    }
}

/* counts[v - low] += 1 for each of the n values: the histogram of a budget pass's eviction scores (LRU's rounds), in
 * one pass and no temporary. Four partial histograms (counts has 4 * span entries, summed by the caller), so that
 * runs of equal values (rows touched in the same round) do not wait on one counter's last increment. Returns the
 * number of values outside [low, low + span) (counted nowhere). */
int64_t count_values_i32(const int32_t *values, int64_t n, int32_t low, int64_t span, int64_t *counts) {
    int64_t outside = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t at = (uint64_t)((int64_t)values[i] - low);
        if (at >= (uint64_t)span) { outside++; continue; }
        counts[(i & 3) * span + (int64_t)at]++;
    }
    return outside;
}
