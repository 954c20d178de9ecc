/* What the units of the compiled fast path (kvstore_lazy.protocol._fast, _fast.so) share: the limited API of
   CPython 3.11 and the headers every unit includes first, and the module's functions, declared by the unit that
   defines each (_fast.c puts them in the module's method table).

   Owns: declarations only. The functions are hidden from the library's symbol table (only PyInit__fast is
   exported): they are reached through the method table, as one file's static functions were. */
#ifndef KVSTORE_LAZY_FAST_H
#define KVSTORE_LAZY_FAST_H

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FAST_INTERNAL __attribute__((visibility("hidden")))

/* _fast_pbmeta.c: the PBMeta codec; fast_pbmeta_init interns the attribute names (0, or -1 with an error set) */
FAST_INTERNAL int fast_pbmeta_init(void);
FAST_INTERNAL PyObject *decode_meta(PyObject *self, PyObject *arg);
FAST_INTERNAL PyObject *encode_meta(PyObject *self, PyObject *dict);

/* _fast_checks.c: a row_sparse request's frames checked in one pass, two frames compared */
FAST_INTERNAL PyObject *sorted_rows(PyObject *self, PyObject *arg);
FAST_INTERNAL PyObject *row_lens(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FAST_INTERNAL PyObject *row_push(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FAST_INTERNAL PyObject *same_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* _fast_rows.c: a pull's rows gathered from a row table, a round's new rows made in it */
FAST_INTERNAL PyObject *gather_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FAST_INTERNAL PyObject *ensure_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* _fast_uniform.c: counter-based uniform initial values (one row's loop: _fast_uniform.h) */
FAST_INTERNAL PyObject *uniform_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* _fast_updates.c: store/kernels.c's update kernels and round merge in one call */
FAST_INTERNAL PyObject *set_update_kernels(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FAST_INTERNAL PyObject *sgd(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FAST_INTERNAL PyObject *sgd_mom(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FAST_INTERNAL PyObject *adam(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
FAST_INTERNAL PyObject *merge_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* _fast_float.c: optimizers.py's float parser */
FAST_INTERNAL PyObject *parse_float32(PyObject *self, PyObject *arg);

#endif
