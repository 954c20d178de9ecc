/* optimizers.py's float parser (dmlc::ParseFloat<float>) for the text str(float) gives, in one call.

   Owns: parse_float32, the same float32 steps as optimizers._dmlc_parse, or None for any other text (the Python
   parser decides). Does not own: the hyper-parameters it parses. */
#include "_fast.h"

/* ---------------------------------------------------------------------------------------------------------------
   parse_float32(text) -> float or None: optimizers._dmlc_parse(text, np.float32) (dmlc::ParseFloat<float>, step by
   step: not correctly rounded), for the ASCII text str(float) gives, which is what a changing hyper-parameter (Adam's
   bias-corrected lr, every update) is parsed from; None for anything else (whitespace, non-ASCII, inf/nan, an
   integer part of more than 15 digits): the Python parser decides. The float32 operations are the ones numpy does
   there, in the same order; the fraction's digits (at most 19, as uint64) become a double, divided by 10**digits
   (exact) in double, as Python's int / float does. */

static const double POW10[20] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14,
                                 1e15, 1e16, 1e17, 1e18, 1e19};

static int is_digit(char c) { return c >= '0' && c <= '9'; }

PyObject *parse_float32(PyObject *self, PyObject *arg) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(arg, &n);
    if (s == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++)
        if ((unsigned char)s[k] <= 0x20 || (unsigned char)s[k] >= 0x80) Py_RETURN_NONE;
    Py_ssize_t i = 0, j;
    int neg = 0;
    if (i < n && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
    if (i < n && (s[i] == 'i' || s[i] == 'I' || s[i] == 'n' || s[i] == 'N')) Py_RETURN_NONE;
    uint64_t whole = 0;
    for (j = i; j < n && is_digit(s[j]); j++) {
        if (j - i == 15) Py_RETURN_NONE;
        whole = whole * 10 + (uint64_t)(s[j] - '0');
    }
    float value = (float)(double)whole;
    i = j;
    if (i < n && s[i] == '.') {
        i++;
        uint64_t digits = 0;
        int count = 0;
        for (j = i; j < n && is_digit(s[j]); j++)
            if (count < 19) digits = digits * 10 + (uint64_t)(s[j] - '0'), count++;
        if (count) value = value + (float)((double)digits / POW10[count]);
        i = j;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        int frac = i < n && s[i] == '-';
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        int expon = 0;
        for (j = i; j < n && is_digit(s[j]); j++)
            if (expon < 38) expon = expon * 10 + (s[j] - '0');
        if (expon > 38) expon = 38;
        float scale = 1.0f;
        while (expon >= 8) scale = scale * 1e8f, expon -= 8;
        while (expon > 0) scale = scale * 10.0f, expon--;
        value = frac ? value / scale : value * scale;
    }
    return PyFloat_FromDouble((double)(neg ? -value : value));
}
