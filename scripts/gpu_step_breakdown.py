"""Where a DeepSpeed pipeline step's time goes on CUDA, set beside the cost model's parts (`pdv bench profile`
missed the measured step by 6-13% on an H200, with the GPU 86-91% busy while training). Trains the bench's
one-stage GPT through `pdv_ext.initialize` for a few steps under torch.profiler, with each of the engine's
instructions (`_exec_forward_pass`, `_exec_optimizer_step`, ...) wrapped in a named range, and prints per step:
the wall time; the GPU's busy and idle time; each instruction's host time and the GPU idle time that fell
inside it (the host was doing that while the device starved); the synchronising calls. Then the profile's
predicted parts (layers' forward + backward, updates, DeepSpeed's per-micro-batch and per-step work).

    python scripts/gpu_step_breakdown.py [--steps 6] [--no-predict]
"""
import argparse
import collections
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-predict", action="store_true")
    args = ap.parse_args()
    from pdv_ext.spawn import free_port

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    import pdv_ext
    from pdv_ext.bench.profile import DEFAULTS as M
    from pdv_ext.models import gpt_layers, lm_loss, seed_layer

    host = collections.defaultdict(float)
    imap = PipelineEngine._INSTRUCTION_MAP  # the schedule calls these functions, not the class attributes
    for cmd, fn in list(imap.items()):
        def wrapped(self, *a, _fn=fn, _k=fn.__name__, **kw):
            t0 = time.perf_counter()
            with record_function("ds" + _k[5:]):
                out = _fn(self, *a, **kw)
            host[_k[6:]] += time.perf_counter() - t0
            return out
        imap[cmd] = wrapped

    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="nccl")
    module = PipelineModule(layers=gpt_layers(M["layers"], M["hidden"], M["heads"], M["seq_len"]), num_stages=1,
                            loss_fn=lm_loss, seed_layers=True, seed_fn=seed_layer, partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": M["micro_batch"], "gradient_accumulation_steps": M["micro_batches"],
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "log_level": "error"}
    engine, _, _, _ = pdv_ext.initialize(model=module, config=cfg, model_parameters=module.parameters())
    ids = torch.randint(0, 256, (M["micro_batch"], M["seq_len"]))

    def data():
        while True:
            yield ids, ids
    it = data()
    for _ in range(5):
        engine.train_batch(data_iter=it)
    torch.cuda.synchronize()
    host.clear()
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.train_batch(data_iter=it)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    n = args.steps
    ev = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in ev
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, gaps, cur_s, cur_e = 0.0, [], None, None
    for s, e in kernels:  # merge overlapping kernels, list the idle gaps between them
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append((cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    ranges = [(e.name, e.time_range.start, e.time_range.end) for e in ev if e.name.startswith("ds_")]
    idle_in = collections.defaultdict(float)
    for gs, ge in gaps:
        for name, rs, re_ in ranges:
            idle_in[name] += max(0.0, min(ge, re_) - max(gs, rs))
    idle_total = sum(ge - gs for gs, ge in gaps)
    syncs = collections.Counter(e.name for e in ev if "Synchronize" in e.name or "MemcpyDtoH" in e.name
                                or e.name in ("aten::item", "aten::_local_scalar_dense"))
    print(f"{torch.cuda.get_device_name()} DeepSpeed {deepspeed.__version__}; {n} steps of {M}")
    print(f"wall per step: median {statistics.median(walls) * 1e3:.1f} ms ({', '.join(f'{w * 1e3:.1f}' for w in walls)})")
    print(f"GPU busy {busy / n / 1e3:.1f} ms/step, idle between kernels {idle_total / n / 1e3:.1f} ms/step")
    outside = idle_total - sum(idle_in.values())
    print(f"instruction: host ms/step | GPU idle inside it ms/step (idle outside every instruction: "
          f"{outside / n / 1e3:.2f})")
    for k in sorted(host, key=lambda k: -host[k]):
        print(f"  {k:22s} {host[k] / n * 1e3:7.2f} | {idle_in['ds_' + k] / n / 1e3:6.2f}")
    print("synchronising calls per step: " + ", ".join(f"{k} {v / n:g}" for k, v in syncs.most_common()))
    top = sorted(((e.key, e.self_cpu_time_total / n / 1e3) for e in prof.key_averages()), key=lambda r: -r[1])[:12]
    print("host self time per step (ms): " + ", ".join(f"{k[:38]} {t:.2f}" for k, t in top))
    from deepspeed.runtime.utils import clip_grad_norm_ as ds_clip
    params = [p for p in engine.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    for name, clip in (("deepspeed clip_grad_norm_", lambda: ds_clip(params, 1.0, mpu=engine.mpu)),
                       ("torch clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)),
                       ("optimizer.step", lambda: engine.optimizer.step())):
        clip()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            clip()
        torch.cuda.synchronize()
        print(f"{name} over {len(params)} tensors: {(time.perf_counter() - t0) / 10 * 1e3:.2f} ms")
    if not args.no_predict:
        from pdv_ext.bench.profile import gpt_profile
        from pdv_ext.placement.profile import engine_overhead

        p = gpt_profile(M, "cuda", engine=False)
        eo = engine_overhead(len(p))
        mbs = M["micro_batches"]
        fb = sum(l.fwd_bwd for l in p.layers)
        up = sum(l.update for l in p.layers)
        print(f"profile: layers fwd+bwd {fb * 1e3:.2f} ms x {mbs} = {fb * mbs * 1e3:.1f}; updates {up * 1e3:.2f}; "
              f"engine per micro-batch {eo['micro_batch'] * 1e3:.2f} x {mbs}, per step {eo['step'] * 1e3:.2f} (CPU-timed);"
              f" whole pass {p.meta.get('whole_pass_seconds', 0) * 1e3:.2f} ms vs layer sum "
              f"{p.meta.get('layer_sum_seconds', 0) * 1e3:.2f}")


if __name__ == "__main__":
    main()
