"""A training job for torchrun (tests/integration/test_torchrun_recovery.py): pipe 2 x data 2 on 4 workers with
in-memory snapshots after every step. With --crash-at S, worker --crash-rank exits abruptly right after step S in
the job's first attempt (torchrun's TORCHELASTIC_RESTART_COUNT = 0), as a process on a lost device would; the
agent restarts every worker, and pdv's start-up resumes from the snapshots (`resume: auto`). Each worker appends
one JSON line per step to --out/rank<R>.jsonl: attempt, step, loss."""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.integration.move_workers import build  # noqa: E402

def pipe2(world: int) -> dict:
    """Two stages, world / 2 replicas each: stage 0 on the first half of the ranks (torchrun numbers a host's
    workers together, so with two hosts each stage runs on one host)."""
    dp = world // 2
    return {"boundaries": [0, 4, 8], "rank_mapping": [list(range(dp)), list(range(dp, 2 * dp))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--crash-rank", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds after each step (a slower job)")
    ap.add_argument("--host-tag", default="", help="(unused: marks a host's processes for the test)")
    args = ap.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    eng, data = build("fp32", pipe2(int(os.environ["WORLD_SIZE"])),
                      {"snapshots": {"root": args.shm, "job": "torchrun-test", "every": 1}})
    with open(os.path.join(args.out, f"{os.environ.get('PDV_HOST', 'h')}-rank{rank}.jsonl"), "a", encoding="utf-8") as log:
        log.write(json.dumps({"attempt": attempt, "start": int(eng.global_steps), "world": int(os.environ["WORLD_SIZE"]),
                              "master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])]}) + "\n")
        while eng.global_steps < args.steps:
            loss = float(eng.train_batch(data_iter=data))
            log.write(json.dumps({"attempt": attempt, "step": int(eng.global_steps), "loss": loss,
                                  "t": time.time()}) + "\n")
            log.flush()
            time.sleep(args.sleep)
            if attempt == 0 and rank == args.crash_rank and eng.global_steps == args.crash_at:
                # lost right after the snapshot of this step is sealed on this host (the writers' keepers included)
                assert eng.pdv_snapshots.wait_sealed(int(eng.global_steps))
                os._exit(17)  # no clean-up, no goodbye: the device is gone
    eng.discard_snapshots()


if __name__ == "__main__":
    main()
