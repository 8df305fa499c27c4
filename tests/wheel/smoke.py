"""Smoke run of an installed pdv_ext wheel: what a user gets from `pip install`.

Run by tests/wheel/check_wheel.py with a fresh environment's python, from a directory outside the source
tree (this file is copied there; its ranks import it from that directory). It checks, and exits non-zero
on the first failure:
1. isolation: pdv_ext and the `pdv` command come from the environment, nothing from the source tree;
2. `pdv --version` prints the installed version; `pdv check-config` accepts the shipped config and
   rejects a broken copy of it (exit 2, naming the key);
3. the fused CPU kernels build from the installed C++ sources into an empty TORCH_EXTENSIONS_DIR and agree
   with the torch reference; without TORCH_EXTENSIONS_DIR the cache is not inside site-packages;
4. two gloo ranks train through `pdv_ext.initialize` with `adasum` (a dense update; replicas end
   bit-identical) and `gossip` (top-k: each step moves at most the two ranks' k entries, the exact sync of
   the last step applies what error feedback held back), losses finite;
5. the docs' commands from the installed package (README.md, docs/getting-started.md and docs/recovery.md, copied next to
   this file): `pdv example` copies the shipped examples, `pdv check-config` accepts their configs, the example
   training runs (4 ranks, 20 steps: the demo and the planned placement) and the plugin templates' run (4 ranks, 5 steps) train as the pages say,
   and the getting-started page's minimal program runs on 2 ranks through the deepspeed launcher.
   Each command run is first found verbatim in one of the pages.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any, Dict, List

import torch

import pdv_ext
from pdv_ext import kernels
from pdv_ext.kernels import cpu, reference
from pdv_ext.spawn import free_port, run_ranks

STEPS = 4
SITE = os.path.realpath(sysconfig.get_paths()["purelib"])


class SmokeFailed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise SmokeFailed(what)
    print(f"[smoke] ok: {what}", flush=True)


def inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root + os.sep)


# ---- 1. isolation ----------------------------------------------------------------------------------
def check_isolation(source_tree: str) -> None:
    check(inside(pdv_ext.__file__, SITE) and not inside(pdv_ext.__file__, source_tree),
          f"pdv_ext is imported from the environment ({os.path.dirname(pdv_ext.__file__)})")
    on_path = [p for p in sys.path if p and inside(p, source_tree)]
    check(not on_path, f"no entry of sys.path is in the source tree {on_path or ''}".rstrip())
    pdv = shutil.which("pdv")
    check(pdv is not None and inside(pdv, sys.prefix), f"the pdv command is the environment's ({pdv})")


# ---- 2. the command line ---------------------------------------------------------------------------
def pdv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pdv", *args], capture_output=True, text=True, timeout=120)


def check_cli(config: str) -> None:
    version = importlib.metadata.version("pdv_ext")
    out = pdv("--version")
    check(out.returncode == 0 and out.stdout.strip() == f"pdv_ext {version}" == f"pdv_ext {pdv_ext.__version__}",
          f"pdv --version prints the installed version ({out.stdout.strip()!r}{out.stderr.strip()})")
    out = pdv("check-config", config)
    check(out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == ["ok"],
          f"pdv check-config {config} says ok ({(out.stdout + out.stderr).strip()[-300:]})")
    with open(config) as f:
        cfg = json.load(f)
    cfg["pdv"]["aggregation"] = {"type": "adasumm"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=".", delete=False) as f:
        json.dump(cfg, f)
    try:
        out = pdv("check-config", f.name)
    finally:
        os.remove(f.name)
    text = out.stdout + out.stderr
    check(out.returncode == 2 and "aggregation" in text and "adasum" in text,
          f"pdv check-config rejects a bad aggregator with exit 2, naming the key ({text.strip()[-200:]!r})")


# ---- 3. the fused CPU kernels, built from the installed sources -------------------------------------
def check_kernels() -> None:
    ext = os.environ.get("TORCH_EXTENSIONS_DIR", "")
    check(bool(ext) and not (os.path.isdir(ext) and os.listdir(ext)),
          f"TORCH_EXTENSIONS_DIR is a fresh, empty directory ({ext})")
    check(inside(cpu.SOURCE, SITE) and os.path.isfile(cpu.SOURCE), f"the C++ source is installed ({cpu.SOURCE})")
    t = time.monotonic()
    backend, reason = kernels.backend(), cpu._state["reason"]
    check(backend == "cpp", f"the fused CPU op builds and loads in {time.monotonic() - t:.0f} s "
                            f"(backend {backend}{': ' + reason if reason else ''})")
    built = [d for d in os.listdir(ext) if d.startswith("pdv_kernels_")]
    check(len(built) == 1 and any(f.endswith(".so") for f in os.listdir(os.path.join(ext, built[0]))),
          f"the op was built here, in {ext}/{built[0] if built else '?'}")
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(n, generator=g) for n in (1, 1000, 70_000)]
    b = [torch.randn(n, generator=g) for n in (1, 1000, 70_000)]
    dots, ref_dots = kernels.adasum_dots(a, b), reference.adasum_dots(a, b)
    check(all(torch.allclose(x, y, rtol=1e-12, atol=0) for x, y in zip(dots, ref_dots)),
          "adasum_dots agrees with the reference (float64 sums)")
    ca, cb = torch.rand(3, dtype=torch.float64, generator=g), torch.rand(3, dtype=torch.float64, generator=g)
    check(all(torch.equal(x, y) for x, y in zip(kernels.adasum_combine(a, b, ca, cb),
                                                reference.adasum_combine(a, b, ca, cb))),
          "adasum_combine is bit-identical to the reference")
    stack = torch.randn(5, 3000, generator=g)
    check(torch.equal(kernels.coordinate_median(stack), reference.coordinate_median(stack))
          and torch.equal(kernels.trimmed_mean(stack, 1), reference.trimmed_mean(stack, 1)),
          "coordinate_median and trimmed_mean are bit-identical to the reference")
    upd, res = torch.randn(5000, generator=g), torch.randn(5000, generator=g)
    res2 = res.clone()
    got, want = kernels.topk_error_feedback(upd, res, 50), reference.topk_error_feedback(upd, res2, 50)
    check(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(res, res2),
          "topk_error_feedback is bit-identical to the reference")
    os.environ.pop("TORCH_EXTENSIONS_DIR")
    try:
        default = cpu.extensions_dir()
    finally:
        os.environ["TORCH_EXTENSIONS_DIR"] = ext
    check(not inside(default, sys.prefix), f"without TORCH_EXTENSIONS_DIR the build cache is outside the environment "
                                           f"({default})")


# ---- 4. two gloo ranks through pdv_ext.initialize --------------------------------------------------
def train_two_ranks(aggregations: Dict[str, Dict[str, Any]], steps: int, seed: int = 5) -> Dict[str, Any]:
    """One rank: the same small MLP (one pipeline stage, data parallel over both ranks), each rank on its own
    data, trained with plain SGD so that equal aggregated updates give equal weights."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    from pdv_ext.models import mlp_layers, seed_layer, synthetic_batches

    # DeepSpeed's own shared-memory op serves inference all-reduce only; building it in a fresh environment
    # takes about a minute and tests nothing of pdv_ext
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out: Dict[str, Any] = {"rank": rank, "kernels": kernels.backend()}
    for name, options in aggregations.items():
        torch.manual_seed(seed)
        model = PipelineModule(layers=mlp_layers(4, 32, 16, 4), num_stages=1, loss_fn=torch.nn.CrossEntropyLoss(),
                               seed_layers=True, seed_fn=seed_layer, base_seed=seed)
        cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
               "steps_per_print": 10 ** 9, "pdv": {"aggregation": {"type": name, **options}}}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, _, _, _ = pdv_ext.initialize(model=model, optimizer=optimizer, config=cfg)
        data = synthetic_batches(16, 4, 4, seed=seed + 100 * rank)  # each replica its own data
        initial = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        losses, synced, changed = [], [], []
        for _ in range(steps):
            before = flat(engine.module)
            losses.append(float(engine.train_batch(data_iter=data)))
            changed.append(int((flat(engine.module) != before).sum()))
            synced.append(bool(engine.aggregator.report.get("synced", False)))
        out[name] = {"aggregator": engine.aggregator.name, "losses": losses, "synced": synced, "changed": changed,
                     "size": flat(engine.module).numel(), "initial": initial,
                     "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}
    return out


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def check_two_ranks() -> None:
    aggs = {"adasum": {}, "gossip": {"peers": 1, "ratio": 0.1, "sync_every": STEPS}}
    t = time.monotonic()
    ranks: List[Dict[str, Any]] = run_ranks("smoke:train_two_ranks", 2, dict(aggregations=aggs, steps=STEPS),
                                            timeout=300)
    print(f"[smoke] two ranks trained with {' and '.join(aggs)} in {time.monotonic() - t:.0f} s", flush=True)
    check(all(r["kernels"] == "cpp" for r in ranks), "the ranks use the fused CPU op")
    for name in aggs:
        r0, r1 = ranks[0][name], ranks[1][name]
        check(r0["aggregator"] == r1["aggregator"] == name, f"{name}: the engine aggregates with {name}")
        check(all(math.isfinite(x) for r in ranks for x in r[name]["losses"]), f"{name}: losses are finite "
              f"({[round(x, 4) for x in r0['losses']]})")
        check(max_diff(r0["weights"], r0["initial"]) > 0, f"{name}: the weights changed")
    adasum = ranks[0]["adasum"]
    check(min(adasum["changed"]) > adasum["size"] // 2,
          f"adasum: every step updates the weights densely ({adasum['changed']} of {adasum['size']})")
    check(all(torch.equal(adasum["weights"][n], ranks[1]["adasum"]["weights"][n]) for n in adasum["weights"]),
          "adasum: both ranks end with bit-identical weights")
    gossip = ranks[0]["gossip"]
    top_k = 2 * math.ceil(aggs["gossip"]["ratio"] * gossip["size"])  # the union of the two ranks' top-k
    check(gossip["synced"] == [False] * (STEPS - 1) + [True] and max(gossip["changed"][:-1]) <= top_k
          and gossip["changed"][-1] > top_k,
          f"gossip: steps before the sync move at most {top_k} of {gossip['size']} weights, the sync more "
          f"(changed {gossip['changed']}, synced {gossip['synced']})")
    diff = max_diff(gossip["weights"], ranks[1]["gossip"]["weights"])
    check(diff < 1e-5, f"gossip: after the exact sync both ranks hold the same weights (max difference {diff:.1e})")


# ---- 5. the docs' commands, from the installed package ----------------------------------------------
#: run in this order, each in a shell in one scratch folder (a `cd` carries over to the next line)
DOC_COMMANDS = [
    "pdv --version",
    "pdv example train_gpt my_job",
    "cd my_job",
    "pdv check-config configs/demo.json --world-size 4",
    "pdv check-config configs/placement.json --world-size 4   # everything the launch will load; \"ok\"",
    "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 4 train_gpt.py --deepspeed_config configs/demo.json "
    "--steps 20",
    "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 4 train_gpt.py --deepspeed_config configs/placement.json "
    "--steps 20",
    "pdv example plugins .",
    "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 4 train_gpt.py --deepspeed_config "
    "configs/my_plugins.json --steps 5",
    "pdv example minimal .",
    "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 2 minimal.py --steps 5",
    # docs/recovery.md: a worker lost after step 10, torchrun restarts the four, they resume from the snapshot
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu torchrun --standalone "
    "--nproc-per-node=4 \\\n    --max-restarts=2 train_gpt.py --deepspeed_config configs/recovery.json --steps 20 "
    "--crash-at 10",
]


#: DeepSpeed's CPU all-reduce workspaces of this user (pdv_ext.spawn.remove_deepspeed_shm says more)
SHM_BUFFERS = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*"


def check_docs(pages: List[str], ds_cache: str) -> None:
    text = "\n".join(open(p, encoding="utf-8").read() for p in pages)
    work = tempfile.mkdtemp(prefix="docs-", dir=".")
    cwd = work
    for line in DOC_COMMANDS:
        check(line in text, f"the docs show `{line}`")
        cmd = line.split("   #")[0].strip()
        if cmd.startswith("cd "):
            cwd = os.path.normpath(os.path.join(cwd, cmd[3:]))
            continue
        env = dict(os.environ)
        if "OMP_NUM_THREADS=1" in cmd and ds_cache:
            env["TORCH_EXTENSIONS_DIR"] = ds_cache  # DeepSpeed's op built once, not minutes in every wheel test
            cmd = cmd.replace("deepspeed --num_gpus", f"deepspeed --master_port {free_port()} --num_gpus")
        t = time.monotonic()
        shm_before = set(glob.glob(SHM_BUFFERS))
        out = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        for path in set(glob.glob(SHM_BUFFERS)) - shm_before:  # DeepSpeed never unlinks its CPU all-reduce
            os.remove(path)                                     # workspaces (69 MB a rank): the run's are gone
        tail = (out.stdout + out.stderr).strip()[-1500:]
        check(out.returncode == 0, f"`{cmd}` runs as written from the installed package "
                                   f"({time.monotonic() - t:.0f} s){'' if out.returncode == 0 else ': ' + tail}")
        if "my_plugins.json" in cmd:
            check("aggregator NormFilteredMean(max_norm=50.0)" in out.stdout + out.stderr
                  and "policies my_policy:PlateauLR(" in out.stdout + out.stderr,
                  "the plugin run named the aggregator and the policy plugins at start-up")
        if "--crash-at" in cmd:
            check("simulated loss of this device after step 10" in out.stdout
                  and "attempt 1: resumed at step 10" in out.stdout and "step   20/20" in out.stdout,
                  "the torchrun run lost a worker after step 10 and finished from the snapshot of step 10")
        if "minimal.py" in cmd:
            check("step 5 loss" in out.stdout and "aggregator adasum" in out.stdout,
                  "the minimal program trained 5 steps with adasum")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a shipped config to check with `pdv check-config`")
    ap.add_argument("--source-tree", required=True, help="the checkout, which must not be on the path")
    ap.add_argument("--docs", nargs="*", default=[], help="README.md and getting-started.md, copied here")
    ap.add_argument("--ds-cache", default="", help="a TORCH_EXTENSIONS_DIR holding DeepSpeed's built ops, if any")
    args = ap.parse_args()
    try:
        check_isolation(args.source_tree)
        check_cli(args.config)
        check_kernels()
        check_two_ranks()
        if args.docs:
            check_docs(args.docs, args.ds_cache)
    except SmokeFailed as exc:
        print(f"[smoke] FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
