/* Optimizer updates and round merges in one call (numerics/optimizers.py, server/keys.py): store/kernels.c's own
   kernels (kernels_optim.c, kernels_rows.c) reached by address, without ctypes' set-up.

   Owns: checking an update's buffers and calling the kernel; returns False (None) for whatever it does not take,
   and the caller takes its own path. Does not own: the arithmetic (the kernels), the hyper-parameters. */
#include "_fast.h"

/* ---------------------------------------------------------------------------------------------------------------
   Optimizer updates in one call, no numpy or ctypes set-up: the update kernels of store/kernels.c themselves
   (sgd_rows, sgd_mom_rows, adam_rows), reached through the addresses optimizers.py hands over once
   (set_update_kernels, from store/kernels.py's loaded library), so the arithmetic is that one compiled code and its
   results are the same bits. `slots` None: a dense array, one row of all its elements (slot 0), the tables and the
   gradient of one shape; else the row tables' rows `slots` (int64, each in [0, rows)) get the gradient's rows (2-D
   tables of one shape, a (len(slots), cols) gradient), as kernels.py's wrappers and kernels.accepts take them.

   set_update_kernels(sgd_rows, sgd_mom_rows, adam_rows, merge_rows_f32): the functions' addresses (ints).
   sgd(weight, slots, grad, lr, wd, rescale, clip) -> bool: kernels.sgd_rows.
   sgd_mom(weight, mom, slots, grad, lr, wd, rescale, clip, momentum) -> bool: kernels.sgd_mom_rows (mom None: no
   momentum state, multi_sgd_update).
   adam(weight, mean, var, slots, grad, lr, wd, beta1, beta2, eps, rescale, clip, square_first) -> bool.
   Each returns False, touching nothing, unless every array is a C-contiguous float32 buffer (int64 slots) of the
   shapes above, the tables writable, or no kernels were handed over: the caller then takes its own path. */

typedef void (*SgdRows)(float *, const int64_t *, int64_t, const float *, int64_t, float, float, float, float);
typedef void (*SgdMomRows)(float *, float *, const int64_t *, int64_t, const float *, int64_t, float, float, float,
                           float, float);
typedef void (*AdamRows)(float *, float *, float *, const int64_t *, int64_t, const float *, int64_t, float, float,
                         float, float, float, float, float, int);
typedef int64_t (*MergeRows)(const int64_t *, const float *, int64_t, const int64_t *, const float *, int64_t, int64_t,
                             int64_t *, float *);
static SgdRows sgd_rows_fn;
static SgdMomRows sgd_mom_rows_fn;
static AdamRows adam_rows_fn;
static MergeRows merge_rows_fn;

PyObject *set_update_kernels(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "set_update_kernels takes 4 arguments"); return NULL; }
    void *sgd = PyLong_AsVoidPtr(args[0]), *sgd_mom = PyLong_AsVoidPtr(args[1]), *adam = PyLong_AsVoidPtr(args[2]);
    void *merge = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) return NULL;
    sgd_rows_fn = (SgdRows)sgd;
    sgd_mom_rows_fn = (SgdMomRows)sgd_mom;
    adam_rows_fn = (AdamRows)adam;
    merge_rows_fn = (MergeRows)merge;
    Py_RETURN_NONE;
}

/* The buffers of an update: `ntables` tables (writable), then the gradient, then the slots (or None). */
typedef struct {
    Py_buffer views[5];
    int held;
    int64_t n, cols;
    const int64_t *slots;
} Update;

static const int64_t ROW0[1] = {0};

static void release_update(Update *u) {
    for (int i = 0; i < u->held; i++) PyBuffer_Release(&u->views[i]);
    u->held = 0;
}

static int same_shape(const Py_buffer *a, const Py_buffer *b) {
    if (a->ndim != b->ndim || a->len != b->len) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

/* 1: the arrays are what the kernels take (views held: release_update); 0: they are not (nothing held). */
static int update_arrays(PyObject *const *tables, int ntables, PyObject *grad, PyObject *slots, Update *u) {
    u->held = 0;
    for (int i = 0; i <= ntables; i++) {
        PyObject *array = i < ntables ? tables[i] : grad;
        int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (i < ntables ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(array, &u->views[i], flags) < 0) { PyErr_Clear(); goto no; }
        u->held++;
        const char *format = u->views[i].format;
        if (u->views[i].itemsize != 4 || format == NULL || strcmp(format, "f") != 0) goto no;
        if (i && i < ntables && !same_shape(&u->views[i], &u->views[0])) goto no;
    }
    Py_buffer *table = &u->views[0], *g = &u->views[ntables];
    if (slots == Py_None) {
        if (!same_shape(g, table)) goto no;
        u->n = 1, u->cols = table->len / 4, u->slots = ROW0;
        return 1;
    }
    Py_buffer *sv = &u->views[ntables + 1];
    if (PyObject_GetBuffer(slots, sv, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) { PyErr_Clear(); goto no; }
    u->held++;
    const char *format = sv->format;
    if (sv->itemsize != 8 || sv->ndim != 1 || format == NULL || (strcmp(format, "l") && strcmp(format, "q"))
            || table->ndim != 2 || g->ndim != 2 || g->shape[0] != sv->shape[0] || g->shape[1] != table->shape[1])
        goto no;
    u->n = sv->shape[0], u->cols = table->shape[1], u->slots = sv->buf;
    for (int64_t i = 0; i < u->n; i++)
        if (u->slots[i] < 0 || u->slots[i] >= table->shape[0]) goto no;
    return 1;
no:
    release_update(u);
    return 0;
}

/* An update's arguments: `want` of them, the tables args[0..ntables), the gradient args[grad_at], the slots
   args[slots_at], `nfloats` float32 scalars from args[first_float] on (into f). 1: the kernel (`ready`: its address
   was handed over) can run (u's views held: end_update), 0: it cannot (return False), -1: an error is set. */
static int begin_update(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int ntables,
                        int grad_at, int slots_at, int first_float, int nfloats, float *f, int ready, Update *u) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return -1;
    }
    for (int i = 0; i < nfloats; i++) {
        f[i] = (float)PyFloat_AsDouble(args[first_float + i]);
        if (f[i] == -1.0f && PyErr_Occurred()) return -1;
    }
    return ready && update_arrays(args, ntables, args[grad_at], args[slots_at], u);
}

static PyObject *end_update(Update *u) {
    release_update(u);
    Py_RETURN_TRUE;
}

PyObject *sgd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    float f[4];
    Update u;
    int ok = begin_update("sgd", args, nargs, 7, 1, 2, 1, 3, 4, f, sgd_rows_fn != NULL, &u);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_False);
    sgd_rows_fn(u.views[0].buf, u.slots, u.n, u.views[1].buf, u.cols, f[0], f[1], f[2], f[3]);
    return end_update(&u);
}

PyObject *sgd_mom(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    float f[5];
    Update u;
    int has_mom = nargs > 1 && args[1] != Py_None;
    int ok = begin_update("sgd_mom", args, nargs, 9, has_mom ? 2 : 1, 3, 2, 4, 5, f, sgd_mom_rows_fn != NULL, &u);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_False);
    sgd_mom_rows_fn(u.views[0].buf, has_mom ? u.views[1].buf : NULL, u.slots, u.n, u.views[has_mom ? 2 : 1].buf,
                    u.cols, f[0], f[1], f[2], f[3], f[4]);
    return end_update(&u);
}

PyObject *adam(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    float f[7];
    Update u;
    int square_first = nargs == 13 ? PyObject_IsTrue(args[12]) : 0;
    if (square_first < 0) return NULL;
    int ok = begin_update("adam", args, nargs, 13, 3, 4, 3, 5, 7, f, adam_rows_fn != NULL, &u);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_False);
    adam_rows_fn(u.views[0].buf, u.views[1].buf, u.views[2].buf, u.slots, u.n, u.views[3].buf, u.cols, f[0], f[1],
                 f[2], f[3], f[4], f[5], f[6], square_first);
    return end_update(&u);
}

/* merge_rows(ids_a, vals_a, ids_b, vals_b) -> (ids, vals) or None: kernels.merge_rows of a dist_sync round (kernels.c
   merge_rows_f32: the union of two sorted unique int64 id lists, rows in both summed a + b) as bytearrays of the
   int64 ids and the float32 rows; None unless the ids are 1-D int64 and the rows C-contiguous float32 (len(ids),
   cols) of one cols (kernels.merge_rows decides). */
PyObject *merge_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "merge_rows takes 4 arguments"); return NULL; }
    if (merge_rows_fn == NULL) Py_RETURN_NONE;
    Py_buffer v[4];
    int held = 0;
    PyObject *ids = NULL, *vals = NULL, *result = NULL;
    for (; held < 4; held++) {
        if (PyObject_GetBuffer(args[held], &v[held], PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            goto fallback;
        }
        const char *format = v[held].format;
        int is_ids = held % 2 == 0;
        if (format == NULL || v[held].itemsize != (is_ids ? 8 : 4) || v[held].ndim != (is_ids ? 1 : 2)
                || (is_ids ? strcmp(format, "l") && strcmp(format, "q") : strcmp(format, "f") != 0)) {
            held++;
            goto fallback;
        }
    }
    int64_t na = v[0].shape[0], nb = v[2].shape[0], cols = v[1].shape[1];
    if (v[1].shape[0] != na || v[3].shape[0] != nb || v[3].shape[1] != cols) goto fallback;
    ids = PyByteArray_FromStringAndSize(NULL, (na + nb) * 8);
    vals = PyByteArray_FromStringAndSize(NULL, (na + nb) * cols * 4);
    if (ids == NULL || vals == NULL) goto done;
    int64_t n = merge_rows_fn(v[0].buf, v[1].buf, na, v[2].buf, v[3].buf, nb, cols,
                              (int64_t *)PyByteArray_AsString(ids), (float *)PyByteArray_AsString(vals));
    if (PyByteArray_Resize(ids, n * 8) < 0 || PyByteArray_Resize(vals, n * cols * 4) < 0) goto done;
    result = Py_BuildValue("(NN)", ids, vals);   /* takes both references */
    ids = vals = NULL;
    goto done;
fallback:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(ids);
    Py_XDECREF(vals);
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    return result;
}
