"""The aggregators as they run on CUDA - the Triton kernels (under Triton's interpreter) and the sync-free
device code paths (`robust.PATHS = "device"`) - on CPU tensors, against the CPU run (C++ kernels, CPU
paths): the GPU tier's comparison (tests/gpu/test_aggregators_gpu.py) without a GPU. Run by
test_agg_device_paths.py in a subprocess (TRITON_INTERPRET=1 must be set before triton is imported):

    TRITON_INTERPRET=1 python tests/unit/agg_device_check.py [CASE ...]

prints one JSON object {case: "ok" | the failure} as its last line. The interpreter is not thread-safe, so
the kernel calls of the in-process ranks are serialised by a lock here.
"""
import json
import os
import sys
import threading
import traceback

NAMES = ["mean", "median", "trimmed_mean", "zeno", "suspicion", "gossip", "gossip_dense_sync"]
CASES = [f"{n}_{m}_{dt}" for n in NAMES for m in (3, 4) for dt in ("float32", "bfloat16")]


def main(cases):
    import torch

    from pdv_ext import kernels as K
    from pdv_ext.aggregation import robust
    from pdv_ext.kernels import triton_gpu as T
    import tests.gpu.test_aggregators_gpu as G

    T.BLOCK, T.SORT_TILE, T.TOPK_BLOCK = 64, 128, 32
    lock = threading.Lock()
    for name in ("adasum_dots", "adasum_combine", "topk_error_feedback", "coordinate_median", "trimmed_mean"):
        fn = getattr(K, name)

        def locked(*a, _fn=fn, **k):
            with lock:
                return _fn(*a, **k)
        setattr(K, name, locked)

    plain_run = G.run

    def run(name, m, dtype, device, steps=2, count_syncs=False):
        if device != "cuda":
            return plain_run(name, m, dtype, device, steps)
        os.environ["PDV_KERNELS"], robust.PATHS = "triton", "device"
        try:
            return plain_run(name, m, dtype, "cpu", steps)
        finally:
            os.environ.pop("PDV_KERNELS", None)
            robust.PATHS = "auto"

    G.run, G.STEPS = run, 2
    G.SHAPES = [(16, 9), (70,), (7,), (3, 5, 2)]  # 251 entries: still several kernel programs per op
    out = {}
    for case in cases:
        name, m, dt = case.rsplit("_", 2)
        try:
            G.test_cuda_matches_cpu(name, int(m), getattr(torch, dt))
            out[case] = "ok"
        except Exception:  # noqa: BLE001 - reported per case
            out[case] = traceback.format_exc(limit=3)[-1500:]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:] or CASES)))
