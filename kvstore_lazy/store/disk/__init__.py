"""The units of the disk tier's segment store; :class:`kvstore_lazy.store.segments.SegmentStore` composes them.

    errors      SegmentError (what is on disk can't be used), DiskError (writing to the directory failed)
    files       every file name a store writes; segment creation, atomic replacement, fsync, hard links
    layout      the record layout and its check word; store.json's description of it
    index       the disk index (row id -> record location), id-based: DenseIndex or RunIndex; the live bits
    records     copies of structured records as bytes (pick, put_at, join)
    pools       the process's named thread pools
    reads       the read path: the fd cache, batch reads on the read pool's threads (io_uring or pread), Take
    writer      the writer thread: handed-over appends, waiting for them, the sticky DiskError
    state       the Protocol of what the units below read and change of the store (none imports the facade)
    rewrite     records written back in place (copy-on-write against snapshots)
    compaction  which sealed segments are compacted, and the compaction of one
    verify      every committed record checked; the one report of a damaged record
    commit      the commit point (index.npz) and the loading of the last commit
    runs        the index out of RAM: a memtable over sorted runs on disk (an LSM index)
    runwork     its background thread (flushes, merges a run file at a time), its groups of runs, its lookup cache
    runfile     one run file of it: blocks, fences, bloom filter, footer; its writer, its reader; the merge
    runcalls    the compiled loops of the runs (store/kernels_runs.c) as checked numpy calls

Callers import from :mod:`kvstore_lazy.store.segments`, which re-exports the names they use.
"""
