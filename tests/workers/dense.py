"""Dense init/push/pull/pushpull, partitioned big arrays, fp16, multi-precision and 2-bit compression."""
import argparse
import os
import sys

import mxnet as mx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import save  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", default="dist_sync")
p.add_argument("--dtype", default="float32")
p.add_argument("--optimizer", default="none", help="none | test | sgd | adam")
p.add_argument("--multi-precision", action="store_true")
p.add_argument("--compression", type=float, default=0.0, help="2-bit threshold; 0 = off")
p.add_argument("--steps", type=int, default=4)
args = p.parse_args()

kv = mx.kv.create(args.mode)
rank, nw = kv.rank, kv.num_workers
if args.compression:
    kv.set_gradient_compression({"type": "2bit", "threshold": args.compression})
if args.optimizer == "test":
    kv.set_optimizer(mx.optimizer.create("test", rescale_grad=0.5, multi_precision=args.multi_precision))
elif args.optimizer == "sgd":
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3, rescale_grad=0.5,
                                      multi_precision=args.multi_precision))
elif args.optimizer == "adam":
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=0.01, wd=1e-4, multi_precision=args.multi_precision))

dt = np.dtype(args.dtype)
shapes = {3: (2, 3), 7: (50, 40), 99: (123, 45)}  # 99 and 7 exceed MXNET_KVSTORE_BIGARRAY_BOUND in the tests
results = {}
for key, shape in shapes.items():
    init = (np.arange(np.prod(shape)).reshape(shape) % 17 / 4.0).astype(dt)
    kv.init(key, mx.nd.array(init, dtype=dt))
for key, shape in shapes.items():
    out = mx.nd.zeros(shape, dtype=dt)
    kv.pull(key, out=out)
    results[f"init_{key}"] = out.asnumpy()
kv._barrier()  # in dist_async a fast worker's pushes would otherwise race the other's init pulls
for step in range(args.steps):
    for key, shape in shapes.items():
        grad = ((np.arange(np.prod(shape)).reshape(shape) * (rank + 1) + step) % 7 - 3).astype(dt) / 2
        if key == 7 and not args.compression:
            out = mx.nd.zeros(shape, dtype=dt)
            kv.pushpull(key, mx.nd.array(grad, dtype=dt), out=out)
            if args.mode == "dist_sync":
                results[f"pushpull_{key}_{step}"] = out.asnumpy()
        else:
            kv.push(key, mx.nd.array(grad, dtype=dt))
            out = mx.nd.zeros(shape, dtype=dt)
            kv.pull(key, out=out)
            if args.mode == "dist_sync":
                results[f"pull_{key}_{step}"] = out.asnumpy()
mx.nd.waitall()  # every push of this worker answered before the barrier (kv._barrier does not wait for them)
kv._barrier()
for key, shape in shapes.items():
    out = mx.nd.zeros(shape, dtype=dt)
    kv.pull(key, out=out)
    results[f"final_{key}"] = out.asnumpy()
save(args.out, rank, results)
print("worker", rank, "done", flush=True)
