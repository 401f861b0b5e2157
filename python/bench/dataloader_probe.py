"""What a DataLoader batch costs the main process, part by part (issue 32): the DataLoader's own
``__next__`` (8 workers ahead), copying the freshly mapped 38.5 MB of shared memory into
page-locked memory on one thread (and again, once mapped), unmapping it, the same with
``madvise(MADV_POPULATE_READ)`` first, and six threads copying six fresh batches at once.
CPU only (a pinned destination needs CUDA for ``pin_memory``).

    python3 python/bench/dataloader_probe.py
"""
import ctypes, os, time, statistics, platform
import numpy as np, torch
from concurrent.futures import ThreadPoolExecutor
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
print("uname", platform.release(), "cpus", os.cpu_count())
SHAPE = (256, 3, 224, 224)
class Fresh(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i):
        out = torch.empty(SHAPE, dtype=torch.uint8); out.share_memory_(); out.fill_(i % 251)
        return out
def populate(t):
    p = t.data_ptr(); a = p & ~4095
    r = libc.madvise(a, p + t.nbytes - a, 22)
    return r, ctypes.get_errno()
dst = torch.empty(SHAPE, dtype=torch.uint8).pin_memory()
dn = dst.numpy()
for mode in ["plain", "populate"]:
    it = iter(torch.utils.data.DataLoader(Fresh(), batch_size=None, num_workers=8, prefetch_factor=4))
    time.sleep(6)
    rows = []
    for k in range(24):
        t0 = time.perf_counter(); x = next(it); t1 = time.perf_counter()
        r = populate(x) if mode == "populate" else (0, 0)
        t2 = time.perf_counter(); np.copyto(dn, x.numpy()); t3 = time.perf_counter()
        np.copyto(dn, x.numpy()); t4 = time.perf_counter()
        del x; t5 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, r))
    med = lambda j: statistics.median(r[j] for r in rows[4:]) * 1e3
    print(f"{mode}: next {med(0):.2f} ms, populate {med(1):.2f}, first copy {med(2):.2f}, second copy {med(3):.2f}, free {med(4):.2f}; madvise rc {rows[-1][5]}")
    del it
# six threads copying six fresh batches at once
for mode in ["plain", "populate"]:
    it = iter(torch.utils.data.DataLoader(Fresh(), batch_size=None, num_workers=8, prefetch_factor=4))
    time.sleep(6)
    xs = [next(it) for _ in range(12)]
    dsts = [torch.empty(SHAPE, dtype=torch.uint8).pin_memory().numpy() for _ in range(6)]
    def job(k):
        x = xs[k]
        if mode == "populate": populate(x)
        np.copyto(dsts[k % 6], x.numpy())
    with ThreadPoolExecutor(6) as ex:
        list(ex.map(job, range(6)))
        t0 = time.perf_counter(); list(ex.map(job, range(6, 12))); t1 = time.perf_counter()
    print(f"{mode}: 6 threads, 6 fresh batches: {(t1 - t0) * 1e3:.2f} ms ({(t1 - t0) / 6 * 1e3:.2f} ms per batch)")
    del xs, it
print("ok")
