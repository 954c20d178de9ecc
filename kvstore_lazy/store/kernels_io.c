/* Batched reads and writes of fixed-size records (store/segments.py's disk segments), called through ctypes (which
 * releases the GIL: a thread pool reads parts in parallel).
 *
 * Owns: runs of adjacent records read or written with pread/pwrite, or through an io_uring per thread where the
 * kernel has one. Does not own: the files, their layout or the records' checks (segments.py, kernels_records.c).
 */
#include "kernels.h"

#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#define HAVE_URING 1
#endif

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
