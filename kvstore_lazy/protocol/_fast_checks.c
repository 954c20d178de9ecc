/* Layout checks of a row_sparse request's frames (protocol/kv.py decode_kv, _row_sparse and _rows), one pass each
   instead of a few numpy calls.

   Owns: sorted_rows, row_lens and row_push: True (or the decoded ids) when the frames are what a worker sends,
   False (None) for anything the Python checks must look at: they name what is wrong; same_bytes, two frames
   compared. Nothing here raises on a peer's bytes. Does not own: what a request means (protocol/kv.py, server/). */
#include "_fast.h"

/* ---------------------------------------------------------------------------------------------------------------
   Layout checks of a row_sparse request (protocol/kv.py _row_sparse, _rows), one pass each instead of a few numpy
   calls: True when the request is what a worker sends, False for anything the Python checks must look at (they
   name what is wrong). */

/* sorted_rows(keys): the uint64 keys frame has row keys strictly increasing from the master key (keys[0]) on, the
   last one at most 2**63 - 1 past it (MXNet's int64 row ids). */
PyObject *sorted_rows(PyObject *self, PyObject *arg) {
    Py_buffer keys;
    if (PyObject_GetBuffer(arg, &keys, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t n = keys.len / 8;
    int ok = keys.len % 8 == 0 && n >= 2;
    if (ok) {
        const unsigned char *kb = keys.buf;
        uint64_t master, previous, key;
        memcpy(&master, kb, 8);
        previous = master;
        for (Py_ssize_t i = 1; i < n && ok; i++) {
            memcpy(&key, kb + 8 * i, 8);
            ok = i == 1 ? key >= master : key > previous;
            previous = key;
        }
        ok = ok && previous - master <= (uint64_t)INT64_MAX;
    }
    PyBuffer_Release(&keys);
    return PyBool_FromLong(ok);
}

/* row_lens(lens, row_bytes, row_size): the int32 lens frame is 0 for the master key, then each row's bytes or
   elements (a stock worker's lens may be either: see kv._rows). */
PyObject *row_lens(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "row_lens takes 3 arguments"); return NULL; }
    long long row_bytes = PyLong_AsLongLong(args[1]), row_size = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer lens;
    if (PyObject_GetBuffer(args[0], &lens, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t n = lens.len / 4;
    int ok = lens.len % 4 == 0 && n >= 1;
    const unsigned char *lb = lens.buf;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        int32_t len;
        memcpy(&len, lb + 4 * i, 4);
        ok = i == 0 ? len == 0 : (len == row_bytes || len == row_size);
    }
    PyBuffer_Release(&lens);
    return PyBool_FromLong(ok);
}


/* row_push(keys, lens, vals_len, itemsize) -> (local_ids, row_size, master) or None: a row_sparse push's frames as a
   worker sends them, checked in one pass: what protocol/kv.py's decode_kv, _row_sparse and _rows check, for a push of
   at least one row (uint64 keys, the row keys strictly increasing from the master key on and at most 2**63 - 1 past
   it; one int32 len per key, 0 for the master key, then each row's bytes or elements; vals_len bytes a whole number
   of rows of whole values). local_ids (a bytearray of int64) are the row keys less the master key. None for
   anything else: kv.py's checks decide and name what is wrong. */
PyObject *row_push(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "row_push takes 4 arguments"); return NULL; }
    Py_ssize_t vals_len = PyLong_AsSsize_t(args[2]), itemsize = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer keys, lens;
    if (PyObject_GetBuffer(args[0], &keys, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &lens, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&keys); return NULL; }
    PyObject *ids = NULL, *result = NULL;
    Py_ssize_t nkeys = keys.len / 8, nrows = nkeys - 1;
    if (keys.len % 8 || nkeys < 2 || lens.len != nkeys * 4 || itemsize <= 0 || vals_len % nrows) goto fallback;
    Py_ssize_t row_bytes = vals_len / nrows, row_size = row_bytes / itemsize;
    if (row_bytes == 0 || row_bytes % itemsize || row_bytes > INT32_MAX) goto fallback;
    const unsigned char *kb = keys.buf, *lb = lens.buf;
    int32_t len;
    memcpy(&len, lb, 4);
    if (len != 0) goto fallback;
    for (Py_ssize_t i = 1; i < nkeys; i++) {
        memcpy(&len, lb + 4 * i, 4);
        if (len != row_bytes && len != row_size) goto fallback;
    }
    uint64_t master, previous, key;
    memcpy(&master, kb, 8);
    ids = PyByteArray_FromStringAndSize(NULL, nrows * 8);
    if (ids == NULL) goto done;
    int64_t *local = (int64_t *)PyByteArray_AsString(ids);
    previous = master;
    for (Py_ssize_t i = 1; i < nkeys; i++) {
        memcpy(&key, kb + 8 * i, 8);
        if (i == 1 ? key < master : key <= previous) goto fallback;
        if (key - master > (uint64_t)INT64_MAX) goto fallback;
        local[i - 1] = (int64_t)(key - master);
        previous = key;
    }
    result = Py_BuildValue("(NnK)", ids, row_size, (unsigned long long)master);   /* takes ids' reference */
    ids = NULL;
    goto done;
fallback:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(ids);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&lens);
    return result;
}

/* same_bytes(a, b): whether two buffers hold the same bytes (one memcmp: a memoryview's == compares item by item,
   ~60 times slower for a 64 KiB keys frame). */
PyObject *same_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "same_bytes takes 2 arguments"); return NULL; }
    Py_buffer a, b;
    if (PyObject_GetBuffer(args[0], &a, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &b, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&a); return NULL; }
    int same = a.len == b.len && (a.len == 0 || memcmp(a.buf, b.buf, (size_t)a.len) == 0);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyBool_FromLong(same);
}
