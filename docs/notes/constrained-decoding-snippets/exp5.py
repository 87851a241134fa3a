import time
import numpy as np
import mlx.core as mx
V=49152; W=(V+31)//32
rng=np.random.default_rng(0)
for rows in (1, 8, 17):
    bm = rng.integers(-2**31, 2**31-1, size=(rows, W), dtype=np.int64).astype(np.int32)
    bm[0] = 0; bm[0, 3] = 1 << 5  # a singleton row
    logits = mx.random.normal((rows, V)); mx.eval(logits)
    ref = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    def a():  # numpy unpackbits -> bool -> where
        allowed = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")[:, :V]
        return mx.where(mx.array(allowed.astype(np.bool_)), logits, -mx.inf)
    def a2():  # numpy unpackbits -> additive float32 bias
        allowed = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little", count=V)
        bias = np.where(allowed, np.float32(0), np.float32(-np.inf))
        return logits + mx.array(bias)
    shifts = mx.arange(32, dtype=mx.uint32)
    def b():  # all-MLX bit extraction
        w = mx.array(bm).view(mx.uint32)
        bits = ((w[:, :, None] >> shifts) & 1).reshape(rows, -1)[:, :V]
        return mx.where(bits.astype(mx.bool_), logits, -mx.inf)
    bcomp = mx.compile(lambda w, l: mx.where((((w[:, :, None] >> shifts) & 1).reshape(w.shape[0], -1)[:, :V]).astype(mx.bool_), l, -mx.inf))
    def c():
        return bcomp(mx.array(bm).view(mx.uint32), logits)
    outs = {}
    for name, f in [("numpy unpackbits+where", a), ("numpy unpackbits+additive", a2), ("mlx shifts+where", b), ("mlx compiled", c)]:
        r = f(); mx.eval(r); outs[name] = r
        n = 30
        t0 = time.perf_counter()
        for _ in range(n):
            r = f(); mx.eval(r)
        dt = (time.perf_counter()-t0)/n
        ok = np.array_equal(np.isfinite(np.array(r)), ref)
        print(f"rows={rows:2d} {name:28s} {dt*1e6:8.0f}us correct={ok}")
