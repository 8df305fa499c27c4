"""The Triton kernels run by Triton's interpreter on CPU tensors, against the torch reference (bit for bit) and
the float64 reference (within the documented bound). Run by test_kernels_triton.py in a subprocess, since
TRITON_INTERPRET=1 must be set before triton is imported and must not leak into other tests:

    TRITON_INTERPRET=1 PDV_KERNELS=triton python tests/unit/kernels_triton_check.py [CASE ...]

prints one JSON object {case: "ok" | the failure} as its last line. Sizes are small (the interpreter runs
a program's block as numpy arrays) and the block sizes are lowered, so every op still spans many programs.

    python tests/unit/kernels_triton_check.py --compile      (without TRITON_INTERPRET)

compiles every kernel for an H100 (sm_90: Triton's compiler and its bundled ptxas, no GPU needed), which
catches what the interpreter lets through (types, unsupported ops in compiled code); same JSON output.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from typing import Optional

DTYPES = ["float32", "bfloat16", "float16", "float64"]
CASES = ([f"{op}_{dt}" for op in ("dots", "combine", "topk", "median", "trimmed") for dt in DTYPES]
         + [f"topktorch_{dt}" for dt in DTYPES[:3]] + [f"pair_{dt}" for dt in DTYPES[:2]]
         + ["radix", "bench", "empty", "tables", "hostcost", "launch"])


def main(cases):
    import torch

    from pdv_ext import kernels as K
    from pdv_ext.kernels import reference as R
    from pdv_ext.kernels import triton_gpu as T

    assert K.backend("cpu") == "triton", K.backend("cpu")
    T.BLOCK, T.SORT_TILE, T.TOPK_BLOCK = 64, 128, 32  # (top-k's count and write: blocks smaller than its prep's)
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(0)

    def same(x, y):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)

    def strided(t):  # the same values as a non-contiguous view
        return torch.stack([t, torch.full_like(t, 7.0)], dim=-1)[..., 0]

    def lists(dt):
        sizes = [0, 1, 7, 64, 65, 200]
        a = [torch.randn(s, generator=g).to(dt) * 3 for s in sizes]
        b = [torch.randn(s, generator=g).to(dt) for s in sizes]
        a.append(torch.tensor([nan, 1.0, inf, 2.0], dtype=dt))
        b.append(torch.tensor([1.0, inf, 1.0, -2.0], dtype=dt))
        a[3], b[4] = strided(a[3]), strided(b[4])  # mixed layouts in one list
        return a, b

    def unaligned(ts):  # the same values as pieces of one buffer, starting one element past a 16-byte line
        flat = torch.zeros(1 + sum(t.numel() for t in ts), dtype=ts[0].dtype)
        out, pos = [], 1
        for t in ts:
            out.append(flat[pos:pos + t.numel()].view(t.shape))
            out[-1].copy_(t)
            pos += t.numel()
        return out

    def dots(dt):
        a, b = lists(dt)
        ua, ub = unaligned(a), unaligned(b)
        assert T._aligned([x.contiguous() for x in a]) and not T._aligned(ua)  # both kernel variants run
        for x, y in zip(K.adasum_dots(ua, ub), K.adasum_dots(a, b)):
            same(x, y)
        got = K.adasum_dots(a, b)
        ref = R.adasum_dots([x.double() for x in a], [y.double() for y in b])  # products exact in float64
        for x, y in zip(got, ref):
            assert x.dtype == torch.float64
            torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13, equal_nan=True)
        for x, y in zip(got, R.adasum_dots(a, b)):
            torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13, equal_nan=True)

    def combine(dt):
        a, b = lists(dt)
        ca = torch.linspace(-1.5, 2.0, len(a), dtype=torch.float64)
        cb = torch.linspace(0.3, 0.9, len(a), dtype=torch.float64)
        ref = R.adasum_combine(a, b, ca, cb)
        ua, ub = unaligned(a), unaligned(b)
        for x, y in zip(K.adasum_combine(ua, ub, ca, cb, out=ua), ref):  # unaligned, written in place
            same(x, y)
        for x, y in zip(K.adasum_combine(a, b, ca, cb), ref):
            same(x, y)
        eps = torch.finfo(dt).eps  # one rounding of the float64 value: within eps/2 relative (+ float32 for 16-bit)
        for i, x in enumerate(ref):
            exact = ca[i] * a[i].double() + cb[i] * b[i].double()
            ok = torch.isfinite(exact)
            torch.testing.assert_close(x.double()[ok], exact[ok], rtol=eps, atol=1e-30)
        outs = [torch.zeros(2 * x.numel(), dtype=dt)[::2].view(x.shape) for x in a]  # strided out
        K.adasum_combine(a, b, ca, cb, out=outs)
        for x, y in zip(outs, ref):
            same(x, y)
        mine = [x.clone() for x in a]  # in place
        K.adasum_combine(mine, b, ca, cb, out=mine)
        for x, y in zip(mine, ref):
            same(x, y)

    def pair(dt):
        """adasum_pair(a, b): its dots and combine equal the free functions' (and the reference's) for every
        kind of `out` (None, a, b, another list, a strided list), on mixed and unaligned layouts."""
        a, b = lists(dt)
        ca = torch.linspace(-1.5, 2.0, len(a), dtype=torch.float64)
        cb = torch.linspace(0.3, 0.9, len(a), dtype=torch.float64)
        ref = R.adasum_combine(a, b, ca, cb)
        for x, y in zip(K.adasum_pair(a, b).dots(), K.adasum_dots(a, b)):
            same(x, y)
        for x, y in zip(K.adasum_pair(a, b).combine(ca, cb), ref):
            same(x, y)
        for layout in (lambda ts: [t.contiguous() for t in ts], unaligned):
            for target in ("a", "b", "other", "strided"):
                mine, theirs = layout([x.clone() for x in a]), layout([y.clone() for y in b])
                p = K.adasum_pair(mine, theirs)
                for x, y in zip(p.dots(), R.adasum_dots(a, b)):
                    torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13, equal_nan=True)
                out = {"a": mine, "b": theirs, "other": [torch.empty_like(x) for x in a],
                       "strided": [torch.zeros(2 * x.numel(), dtype=dt)[::2].view(x.shape) for x in a]}[target]
                assert p.combine(ca, cb, out=out) == list(out)
                for x, y in zip(out, ref):
                    same(x, y)
        try:
            K.adasum_pair(a, b[:-1])
            raise AssertionError("a pair of lists of different lengths was accepted")
        except ValueError as e:
            assert "b:" in str(e), e

    def launch(_):
        """_launch: the first launch of a specialisation goes through the kernel's JIT path, later ones
        straight to the compiled kernel; another dtype, alignment or int value (a constexpr, say) goes
        through the JIT path again; PDV_TRITON_LAUNCH=jit keeps the JIT path; a kernel that returns nothing
        (the interpreter) is never cached."""
        calls = []

        class Compiled:  # Triton's CompiledKernel[grid] runner reads grid[0], grid[1] and grid[2]
            def __getitem__(self, grid):
                assert len(grid) == 3, grid
                return lambda *args: calls.append(("direct", grid, args))

        class Kernel:
            def __init__(self, returns):
                self.returns = returns

            def __getitem__(self, grid):
                def run(*args, **opts):
                    calls.append(("jit", grid, args))
                    return self.returns
                return run

        kern, buf, other = Kernel(Compiled()), torch.zeros(64), torch.ones(64)
        T._launch(kern, (4,), buf, 32, 7)
        T._launch(kern, (4,), other, 32, 7)  # another tensor of the same dtype and alignment
        assert [c[0] for c in calls] == ["jit", "direct"] and calls[1][2][0] is other, calls
        assert calls[0][1] == (4,) and calls[1][1] == (4, 1, 1), calls  # the JIT path pads a grid itself
        for args in ((buf[1:], 32, 7), (buf, 48, 7), (buf, 1, 7), (buf, 2 ** 40, 7), (buf, 32, 8),  # ints: by value
                     (buf.double(), 32, 7), (buf, 32, True), (buf, 32, 7.0)):
            calls.clear()
            T._launch(kern, (4,), *args)
            assert [c[0] for c in calls] == ["jit"], (args, calls)
        calls.clear()
        T._launch(kern, (8,), buf, 32, 7)  # another grid
        assert [c[0] for c in calls] == ["jit"], calls
        calls.clear()
        os.environ["PDV_TRITON_LAUNCH"] = "jit"
        try:
            T._launch(kern, (4,), buf, 32, 7)
        finally:
            del os.environ["PDV_TRITON_LAUNCH"]
        assert [c[0] for c in calls] == ["jit"], calls
        calls.clear()
        nothing = Kernel(None)
        T._launch(nothing, (4,), buf, 32, 7)
        T._launch(nothing, (4,), buf, 32, 7)
        assert [c[0] for c in calls] == ["jit", "jit"], calls

    def topk(dt):
        cases = [(torch.randint(-3, 4, (300,), generator=g).to(dt), torch.zeros(300, dtype=dt), k)
                 for k in (1, 50, 150, 299)]  # many ties across blocks
        cases += [(torch.randn(200, generator=g).to(dt), torch.randn(200, generator=g).to(dt), 37)]
        sp = torch.tensor([nan, 1.0, -inf, 0.0, -0.0, 3.0, nan, inf, -3.0, 2.0], dtype=dt)
        cases += [(sp, torch.zeros(10, dtype=dt), k) for k in (0, 1, 2, 3, 5, 9, 10)]
        cases += [(torch.empty(0, dtype=dt), torch.empty(0, dtype=dt), 3)]
        for u, r, k in cases:
            r1, r2 = r.clone(), r.clone()
            i1, v1 = K.topk_error_feedback(u, r1, k)
            i2, v2 = R.topk_error_feedback(u, r2, k)
            same(i1, i2), same(v1, v2), same(r1, r2)
            assert i1.dtype == torch.int64 and i1.numel() == min(k, u.numel())
        u, r = torch.randn(2, 150, generator=g).to(dt), torch.randn(150, 2, generator=g).to(dt)
        r1, r2 = r.t(), r.t().contiguous()  # strided residual, updated in place
        i1, v1 = K.topk_error_feedback(u.t(), r1, 40)
        i2, v2 = R.topk_error_feedback(u.t().contiguous(), r2, 40)
        same(i1, i2), same(v1, v2), same(r1, r2)

    def topktorch(dt):  # top-k with torch.topk's threshold in place of the default radix select
        os.environ["PDV_TOPK_SELECT"] = "torch"
        try:
            topk(dt)
        finally:
            del os.environ["PDV_TOPK_SELECT"]

    def radix(_):
        """_radix_threshold == torch.topk(key, k).values.min(): random keys, many ties, k = 1 and n, the keys
        of NaN (canonical) and +inf, small and odd sizes; with few programs each loops over several blocks."""
        default = T.RADIX_PROGRAMS
        special = torch.tensor([0x7FC00000, 0x7F800000, 0x7F7FFFFF, 0, 1], dtype=torch.int32)  # NaN, +inf, ...
        wide = torch.randint(0, 0x7F800000, (333,), generator=g, dtype=torch.int32)
        mixed = torch.where(wide % 5 < 2, special[wide % 5], wide)
        few = special[torch.randint(0, 5, (333,), generator=g)]
        for programs, key, ks in ((default, wide[:1], (1,)), (default, few[:5], (1, 3, 5)),
                                  (default, wide, (1, 100)), (default, wide % 4, (2, 333)),  # many ties
                                  (default, wide % 3 + 0x3F800000, (100,)),  # ties: only the last digit differs
                                  (default, mixed, (1, 100)), (default, few, (2, 332)),
                                  (3, wide % 3 + 0x3F800000, (100,)), (3, mixed, (100,))):  # 3 programs: each
            T.RADIX_PROGRAMS = programs                                                   # loops over blocks
            for k in ks:
                got = T._radix_threshold(key.contiguous(), k)
                want = torch.topk(key, k).values.min()
                assert got.shape == () and got.dtype == torch.int32 and int(got) == int(want), (key.numel(), k, got,
                                                                                                 want)
        T.RADIX_PROGRAMS = default
        try:
            T.topk_select("bogus")
            raise AssertionError("no ValueError")
        except ValueError:
            pass
        assert T.topk_select() == "radix" and T.topk_select("TORCH") == "torch"

    def bench(_):
        """`pdv bench kernels` times each threshold finder beside the default wherever Triton answers (CUDA;
        here the interpreter), and their cases run and agree."""
        from pdv_ext.bench import kernels as B

        cases = B._cases(500, 4, "cpu", torch.float32)
        assert {"topk_radix", "topk_torchselect", "topk_fused"} <= set(cases)
        idx, vals = cases["topk_radix"][0]()
        assert idx.numel() == vals.numel() == 5 and bool((idx.diff() > 0).all())
        idx2, _ = cases["topk_torchselect"][0]()  # (the residual moved on: another selection, same size)
        assert idx2.numel() == 5 and bool((idx2.diff() > 0).all())

    def stacks(dt):
        for m in (1, 2, 3, 4, 5, 8):
            s = torch.randn(m, 131, generator=g).to(dt)
            s[0, ::7], s[-1, ::5], s[m // 2, ::3] = nan, inf, -inf
            yield s
        yield torch.randn(16, 70, generator=g).to(dt)
        yield torch.randint(-2, 3, (6, 90), generator=g).to(dt)  # ties
        yield torch.randn(4, 0).to(dt)
        yield torch.randn(5, 40, generator=g).to(dt).t().contiguous().t()  # column stride != 1
        yield torch.randn(3, 300, generator=g).to(dt)[:, 10:250:2]

    def median(dt):
        for s in stacks(dt):
            same(K.coordinate_median(s), R.coordinate_median(s))

    def trimmed(dt):
        for s in stacks(dt):
            for trim in sorted({0, 1, (s.shape[0] - 1) // 2} & set(range((s.shape[0] - 1) // 2 + 1))):
                got = K.trimmed_mean(s, trim)
                same(got, R.trimmed_mean(s, trim))
                exact = R.trimmed_mean(s.double(), trim)  # float64 values: one rounding away
                ok = torch.isfinite(exact)
                torch.testing.assert_close(got.double()[ok], exact[ok], rtol=torch.finfo(dt).eps, atol=1e-30)

    def empty(_):
        d = K.adasum_dots([], [])
        assert all(x.numel() == 0 and x.dtype == torch.float64 for x in d)
        assert K.adasum_combine([], [], torch.empty(0), torch.empty(0)) == []
        z = [torch.empty(0), torch.empty(0, 3)]
        assert [x.tolist() for x in K.adasum_dots(z, z)] == [[0.0, 0.0]] * 3
        assert [x.numel() for x in K.adasum_combine(z, z, torch.ones(2), torch.ones(2))] == [0, 0]

    def tables(_):
        """Cached tables are keyed by sizes / relative offsets: another buffer split alike reads its own data."""
        sizes = [100, 0, 57, 143]
        bufs = [torch.randn(300, generator=g) for _ in range(2)]
        for buf in (bufs[0], bufs[1], bufs[0], bufs[1].double()):
            a, b = list(buf.split(sizes)), list((buf * 2 - 1).split(sizes))
            for x, y in zip(K.adasum_dots(a, b), R.adasum_dots(a, b)):
                torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13)
            c = torch.tensor([0.5, 1.0, -1.0, 2.0], dtype=torch.float64)
            for x, y in zip(K.adasum_combine(a, b, c, c), R.adasum_combine(a, b, c, c)):
                same(x, y)

    def hostcost(_):
        """Issue #39: an Adasum level (adasum_dots + adasum_combine(out=a)) of 61 tensors cost ~420 us of host
        time on the H200's host, 4x its kernels. With a known layout it is 3 launches, at most 2 torch ops
        that reach ATen (the dots' output and its unbind) and a bounded number of Python-level tensor calls
        per tensor (computing the layout key); results on cache hits stay the reference's, and a layout
        that changes under the same addresses (a transposed view) is not taken for the cached one."""
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        sizes = [16, 48, 16, 64, 16, 80] * 10 + [33]  # 61 tensors, GPT-like: weights and small vectors
        fa, fb = torch.randn(sum(sizes), generator=g), torch.randn(sum(sizes), generator=g)
        a, b = list(fa.split(sizes)), list(fb.split(sizes))
        half = torch.full((len(a),), 0.5, dtype=torch.float64)
        for _ in range(3):  # interpreted: the first call fills the cache, the next ones hit it
            want_d = R.adasum_dots(a, b)
            want_c = R.adasum_combine(a, b, half, half)
            for x, y in zip(K.adasum_dots(a, b), want_d):
                torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-13)
            for x, y in zip(K.adasum_combine(a, b, half, half, out=a), want_c):
                same(x, y)
        sq = torch.randn(8, 8, generator=g)
        for view in (sq, sq.t()):  # same address, size and dtype; the transposed one is not contiguous
            same(K.adasum_combine([view], [view], half[:1], half[:1], out=[torch.empty(8, 8)])[0],
                 R.adasum_combine([view], [view], half[:1], half[:1])[0])

        launches = []

        class Fake:  # the launcher, counted instead of run
            def __init__(self, name):
                self.name = name

            def __getitem__(self, grid):
                return lambda *args, **kw: launches.append(self.name)

        class Aten(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops.append(str(func))
                return func(*args, **(kwargs or {}))

        class Calls(TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.n = 0

            def __torch_function__(self, func, types, args=(), kwargs=None):
                self.n += 1
                return func(*args, **(kwargs or {}))

        saved = {k: getattr(T, k) for k in ("_dots_partial", "_dots_reduce", "_combine")}
        try:
            for k in saved:
                setattr(T, k, Fake(k))

            def level():
                K.adasum_dots(a, b)
                K.adasum_combine(a, b, half, half, out=a)

            def pair_level():  # as the aggregator runs a level: the lists' layout worked out once
                p = K.adasum_pair(a, b)
                p.dots()
                p.combine(half, half, out=a)

            level()
            launches.clear()
            with Aten() as aten:
                level()
            assert launches == ["_dots_partial", "_dots_reduce", "_combine"], launches
            with Calls() as calls:
                level()
            pair_level()
            launches.clear()
            with Aten() as pair_aten:
                pair_level()
            assert launches == ["_dots_partial", "_dots_reduce", "_combine"], launches
            with Calls() as pair_calls:
                pair_level()
        finally:
            for k, v in saved.items():
                setattr(T, k, v)
        assert len(aten.ops) <= 2 and len(pair_aten.ops) <= 2, (aten.ops, pair_aten.ops)
        assert calls.n <= 20 * len(a), f"{calls.n} torch calls for {len(a)} tensors"
        # the pair reads each tensor's layout once for both calls (4 tensor calls a tensor per list), the
        # free functions once per call
        assert pair_calls.n <= calls.n - 6 * len(a), (pair_calls.n, calls.n)

    ops = {"dots": dots, "combine": combine, "topk": topk, "topktorch": topktorch, "median": median,
           "trimmed": trimmed, "pair": pair}
    out = {}
    for case in cases:
        op, _, dt = case.partition("_")
        try:
            special = {"empty": empty, "tables": tables, "radix": radix, "bench": bench, "hostcost": hostcost,
                       "launch": launch}
            special.get(case, ops.get(op))(getattr(torch, dt) if dt else None)
            out[case] = "ok"
        except Exception:
            out[case] = traceback.format_exc(limit=4)[-2000:]
    print(json.dumps(out))


#: the 16-byte vector load of each dtype in PTX
_VEC = {"fp32": "ld.global.v4.b32", "bf16": "ld.global.v4.b32", "fp64": "ld.global.v2.b64"}


def compile_all():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdv_ext.kernels import triton_gpu as T

    def sig(names, **types):
        return {n: types.get(n, "*i64") for n in names}

    out = {}

    def registers(cubin: bytes) -> Optional[int]:
        """Registers a thread of the compiled kernel holds (cuobjdump -res-usage, bundled with Triton)."""
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if not os.path.exists(tool):
            return None
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        found = re.search(r"REG:(\d+)", usage)
        return int(found.group(1)) if found else None

    def comp(name, fn, signature, consts, must=None, must_not=None, max_regs=None, **opts):
        try:
            src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in consts}}, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
            ptx = compiled.asm["ptx"]
            assert ptx
            if max_regs is not None:  # occupancy: more registers a thread, fewer programs a multiprocessor
                regs = registers(compiled.asm["cubin"])
                assert regs is None or regs <= max_regs, f"{regs} registers a thread (at most {max_regs})"
            if must is not None:  # e.g. 16-byte vector loads: what the ALIGN hint is for
                assert must in ptx, f"no '{must}' in the PTX"
            if must_not is not None:  # e.g. a division whose rounding another device does not share
                assert must_not not in ptx, f"'{must_not}' in the PTX"
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc(limit=3)[-2000:]

    lists = ["A", "AO", "B", "BO"]
    for dt in ("fp32", "bf16", "fp64"):
        p, key = "*" + dt, "*i64" if dt == "fp64" else "*i32"
        for align in (False, True):  # 16-byte aligned segments: vector loads and stores on full blocks
            comp(f"dots_partial_{dt}_align{int(align)}", T._dots_partial, sig(lists + ["REF", "seg_of", "start_of",
                 "sizes", "part", "nblocks"], A="i64", B="i64", REF=p, part="*fp64", nblocks="i32"),
                 {"BLOCK": 4096, "ALIGN": align}, must=_VEC[dt] if align else None)
            comp(f"combine_{dt}_align{int(align)}", T._combine, sig(lists + ["O", "OO", "REF", "seg_of", "start_of",
                 "sizes", "CA", "CB"], A="i64", B="i64", O="i64", REF=p, CA="*fp64", CB="*fp64"),
                 {"BLOCK": 4096, "ALIGN": align}, must=_VEC[dt] if align else None, enable_fp_fusion=False)
        comp(f"topk_prep_{dt}", T._topk_prep, sig(["U", "R", "KEY", "n"], U=p, R=p, KEY=key, n="i32"), {"BLOCK": 4096})
        comp(f"topk_count_{dt}", T._topk_count, sig(["KEY", "THR", "counts", "n", "nblocks"], KEY=key, THR=key,
             n="i32", nblocks="i32"), {"BLOCK": T.TOPK_BLOCK})
        # the write's two block-wide scans: 193 registers a thread at 4096 (2 programs a multiprocessor; 201 us
        # at 64 MB on an H200), 72 at 1024 (float32 keys, sm_90, Triton 3.9)
        comp(f"topk_write_{dt}", T._topk_write, sig(["KEY", "R", "THR", "base", "ties_before", "NEED", "IDX", "VALS",
             "n"], KEY=key, R=p, THR=key, VALS=p, n="i32"), {"BLOCK": T.TOPK_BLOCK}, max_regs=96)
        if dt == "fp32":  # the radix select (int32 keys: every dtype but float64)
            for ps in range(T.RADIX_PASSES):
                comp(f"radix_hist_pass{ps}", T._radix_hist, sig(["KEY", "BINS", "K", "n"], KEY=key, BINS="*i32",
                     K="i32", n="i32"), {"PASS": ps, "NPASS": T.RADIX_PASSES, "BITS": T.RADIX_BITS,
                                         "NB": 1 << T.RADIX_BITS, "BLOCK": 4096})
        for m in (1, 4, 5, 16):
            mp2 = max(2, triton.next_power_of_2(m))
            for median in (True, False):
                comp(f"sorted_rows_{dt}_m{m}_{'median' if median else 'trimmed'}", T._sorted_rows,
                     sig(["S", "OUT", "n", "stride"], S=p, OUT=p, n="i32", stride="i32"),
                     {"M": m, "MP2": mp2, "TRIM": (m - 1) // 2, "MEDIAN": median, "F": 64 if dt == "fp64" else 32,
                      "BLOCK": 4096 // mp2})
    # float64 trimmed mean of 3 kept values: a correctly rounded division (div.rn.f64), as the CPU and the
    # reference divide - not a product with a rounded reciprocal (what torch's CUDA division by a Python
    # number does: 1 ulp off the reference in ~15% of elements on an H200)
    comp("sorted_rows_fp64_m3_trim0", T._sorted_rows, sig(["S", "OUT", "n", "stride"], S="*fp64", OUT="*fp64",
         n="i32", stride="i32"), {"M": 3, "MP2": 4, "TRIM": 0, "MEDIAN": False, "F": 64, "BLOCK": 1024},
         must="div.rn.f64", must_not="rcp.")
    comp("radix_final", T._radix_final, sig(["BINS", "K", "OUT"], BINS="*i32", K="i32", OUT="*i32"),
         {"NPASS": T.RADIX_PASSES, "BITS": T.RADIX_BITS, "NB": 1 << T.RADIX_BITS})
    comp("dots_reduce", T._dots_reduce, sig(["part", "first", "out", "nblocks", "nseg"], part="*fp64", out="*fp64",
         nblocks="i32", nseg="i32"), {"RB": 256})
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile"]:
        compile_all()
    else:
        main(sys.argv[1:] or CASES)
