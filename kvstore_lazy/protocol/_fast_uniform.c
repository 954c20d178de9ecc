/* Counter-based uniform initial values of rows (numerics/initializers.py UniformRows, uniform01), in one call.

   Owns: uniform_rows, the Python entry of _fast_uniform.h's per-row loop. Does not own: the seeds' absorption
   into key_state, the bounds (initializers.py). */
#include "_fast.h"
#include "_fast_uniform.h"

/* ---------------------------------------------------------------------------------------------------------------
   uniform_rows(out, row_ids, key_state, span, low, itemsize): for every row r (uint64 row_ids) and column c of the
   (len(row_ids), ncols) float32 (itemsize 4) or float64 (8) `out`, in float64: u = (bits(r, c) >> 11) * 2**-53,
   then u * span, then + low, cast to out's type (initializers.UniformRows; uniform01 is span 1, low 0). key_state
   is absorb(absorb(0, seed), key), so state(r) = mix64((r ^ key_state) + GAMMA), bits = mix64(state + (c+1) GAMMA). */

PyObject *uniform_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "uniform_rows takes 6 arguments"); return NULL; }
    uint64_t key_state = PyLong_AsUnsignedLongLong(args[2]);
    double span = PyFloat_AsDouble(args[3]), low = PyFloat_AsDouble(args[4]);
    Py_ssize_t itemsize = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "uniform_rows writes float32 or float64");
        return NULL;
    }
    Py_buffer out, ids;
    if (PyObject_GetBuffer(args[0], &out, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &ids, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&out); return NULL; }
    Py_ssize_t nrows = ids.len / 8;
    if (ids.len % 8 || (nrows == 0 ? out.len != 0 : out.len % (nrows * itemsize))) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_ValueError, "uniform_rows: out is not len(row_ids) rows of whole values");
        return NULL;
    }
    Py_ssize_t ncols = nrows ? out.len / (nrows * itemsize) : 0;
    const unsigned char *idb = ids.buf;
    for (Py_ssize_t i = 0; i < nrows; i++) {
        uint64_t r;
        memcpy(&r, idb + 8 * i, 8);
        uniform_row((char *)out.buf + i * ncols * itemsize, ncols, itemsize, r, key_state, span, low);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&ids);
    Py_RETURN_NONE;
}
