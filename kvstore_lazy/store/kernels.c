/* The compiled kernels of the row store, the disk tier and the SGD/Adam updates: one plain C library, _kernels.so,
 * called through ctypes (setup.py builds it at install time from the units below; kernels.py loads it).
 *
 * Each function replaces a chain of whole-array numpy passes, and the temporaries between them, with one loop over
 * the rows a request touches. Arrays are C-contiguous; kernels.py checks dtypes, shapes and slot ranges first.
 *
 * Float arithmetic is float32, operation by operation in the order of the numpy reference in optimizers.py (itself
 * the order of MXNet 1.9.1's kernels). Built with -ffp-contract=off and without -ffast-math, so the compiler neither
 * fuses multiply-adds nor reassociates: results are bit-identical to the numpy path (tests/test_optimizers.py).
 *
 * The units, one concern each (each opens by saying what it owns):
 *   kernels.h          what they share (headers, the hash of RowIndex, PREFETCH)
 *   kernels.c          this file: the digest of the sources the library was built from
 *   kernels_index.c    the linear-probing hash index of row ids (RowIndex: lookup, place, remove)
 *   kernels_rows.c     rows in memory: a round's merge of two row_sparse gradients, row moves, value histograms
 *   kernels_optim.c    the optimizer steps on table rows in place (SGD, SGD with momentum, Adam)
 *   kernels_normal.c   Box-Muller with log/sin/cos of IEEE basic operations (the Normal initializers)
 *   kernels_io.c       batched record reads and writes of the disk segments (pread/pwrite, io_uring)
 *   kernels_records.c  the records of the disk tier: their checks, and rows packed into and out of them
 *   kernels_catchup.c  dense-update semantics: rows brought over the zero-gradient steps they missed
 *   kernels_runs.c     the disk index's sorted runs: bloom filters, the probe of a batch, the search in a block, merges
 */
#include "kernels.h"

#ifndef KERNELS_DIGEST
#error "build with -DKERNELS_DIGEST=\"<sha256 of its sources>\" (setup.py does)"
#endif

/* The SHA-256 of the sources this library was built from (all the units above: setup.py's digest): kernels.py
 * refuses a library older than any of them. */
const char *kernels_digest(void) { return KERNELS_DIGEST; }
