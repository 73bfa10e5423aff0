"""Run under valgrind by test_sanitizers.py: ump's C extension inside a real
Python process, called by NumPy through numpy_allocator (where ASan cannot
go without rebuilding Python), plus the VMM pool's emulated layer. Ends with
one deliberate read of freed memory, so the test can see valgrind is awake."""
import numpy as np, ump, random, ctypes
from ump._vmm import VMMPool
ump.enable("host", cap=256 << 20)
rng = random.Random(0)
live = []
for i in range(2000):
    if live and rng.random() < 0.45:
        a, v = live.pop(rng.randrange(len(live)))
        assert a[0] == v and a[-1] == v
    else:
        n = rng.choice([1, 7, 100, 700, 5000, 70000, 300000])
        v = rng.randrange(1000)
        a = np.full(n, v, dtype=np.int32)
        if rng.random() < 0.2:
            a = np.resize(a, n * 2); a[:] = v
        live.append((a, v))
del live
ump.trim()
ump.disable()
p = VMMPool(emulate=True, reserve=1 << 30)
ptrs = [p.allocate(rng.randrange(1, 3 << 20)) for _ in range(200)]
for q in ptrs[::2]: p.deallocate(q)
b = p.buffer(64 << 20, 5 << 20); b.resize(20 << 20); ctypes.memset(b.ptr, 1, 20 << 20); b.close()
for q in ptrs[1::2]: p.deallocate(q)
shared = p.allocate_shared(5 << 20); shared.array()[:] = 3
with shared.export() as h, ump.import_handle(h, p) as imported:
    assert imported.array()[-1] == 3
ring = p.ring(2 << 20); ring.array()[(2 << 20) - 2:(2 << 20) + 2] = 9
blk = p.allocate(3 << 20); alias = p.alias(blk, 3 << 20); ctypes.memset(alias.ptr, 2, 3 << 20)
stripes = p.striped(6 << 20, [0, 1]); ctypes.memset(stripes.ptr, 4, 6 << 20)
for v in (shared, ring, alias, stripes): v.close()
p.deallocate(blk)
p.trim(); p.close()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
probe = libc.malloc(4321)
libc.free(probe)
ctypes.string_at(probe, 8)  # the deliberate error valgrind must report
print("done")
