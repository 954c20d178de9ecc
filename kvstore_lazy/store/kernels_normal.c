/* Normal initial values' transform (numerics/initializers.py NormalRows): Box-Muller of uniforms in [0, 1).
 *
 * Owns: log, sin and cos of IEEE basic operations only, and the Box-Muller pairs made with them. Does not own: the
 * uniforms (the counter-based generator of initializers.py, protocol/_fast_uniform.h).
 */
#include "kernels.h"

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
