# minimal.py: a complete pdv_ext program. Run it on 2 CPU ranks with
#   OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu deepspeed --num_gpus 2 minimal.py --steps 5
import argparse

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

import pdv_ext
from pdv_ext.models import seed_layer

CONFIG = {  # a DeepSpeed config with a "pdv" section (a JSON file's path works too)
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
    "steps_per_print": 10**9,
    "pdv": {"aggregation": {"type": "adasum"}},
}


def batches(seed):
    """An endless stream of (inputs, labels) micro-batches: a random teacher's classes."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=g)
    while True:
        x = torch.randn(CONFIG["train_micro_batch_size_per_gpu"], 16, generator=g)
        yield x, (x @ teacher).argmax(-1)


@pdv_ext.exit_on_config_error  # a bad config: its lines once, exit status 2, no traceback per rank
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages (ranks / stages = replicas)")
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    args = parser.parse_args()
    pdv_ext.load_pdv(CONFIG)  # check the "pdv" section before any process group starts
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    model = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 16, 64), LayerSpec(torch.nn.ReLU),
                                   LayerSpec(torch.nn.Linear, 64, 64), LayerSpec(torch.nn.ReLU),
                                   LayerSpec(torch.nn.Linear, 64, 4)],
                           num_stages=args.stages, loss_fn=torch.nn.CrossEntropyLoss(),
                           seed_layers=True, seed_fn=seed_layer)  # weights independent of the placement
    engine, _, _, _ = pdv_ext.initialize(args=args, model=model, model_parameters=model.parameters(),
                                         config=CONFIG)
    train_iter = batches(seed=engine.grid.get_data_parallel_id())  # each replica its own data
    for step in range(1, args.steps + 1):
        loss = engine.train_batch(data_iter=train_iter)
        if engine.global_rank == 0:
            print(f"step {step} loss {float(loss):.4f}", flush=True)
    torch.distributed.barrier()  # leave together: no rank tears gloo down while a peer finishes the last step
    torch.distributed.destroy_process_group()  # (without it a rank may abort at exit: "terminate called ...")


if __name__ == "__main__":
    main()
