"""Rank side of tests/integration/test_startup_summary.py: `pdv_ext.initialize` with pdv_ext's logger
captured, the config given as `--deepspeed_config` (args)."""
from __future__ import annotations

import json
import logging
import os
from argparse import Namespace
from typing import Any, Dict


def stage_aggregator(**options: Any):
    """An aggregator factory ("module:function") that builds a different aggregator per stage (rank 0 runs
    stage 0 in the test's 2 x 1 grid): what the summary must report stage by stage."""
    from pdv_ext.aggregation import build_aggregator

    return build_aggregator("mean" if os.environ.get("RANK", "0") == "0" else "median")


def init_and_capture(config_path: str) -> Dict[str, Any]:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.log import logger
    from pdv_ext.models import mlp_layers, seed_layer

    seen = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.levelno, record.getMessage()))

    logger.addHandler(Capture())
    deepspeed.init_distributed(dist_backend="gloo")
    model = PipelineModule(layers=mlp_layers(4, 16, 16, 4), num_stages=2, loss_fn=torch.nn.CrossEntropyLoss(),
                           seed_layers=True, seed_fn=seed_layer)
    args = Namespace(deepspeed_config=config_path, local_rank=int(os.environ["LOCAL_RANK"]))
    engine, _, _, _ = pdv_ext.initialize(args=args, model=model, model_parameters=model.parameters())
    return {"rank": dist.get_rank(), "stage": engine.stage_id, "args_config": args.deepspeed_config,
            "summary": engine.pdv_startup_summary,
            "lines": [m for lvl, m in seen],
            "levels": sorted({lvl for lvl, m in seen})}


def write_config(path: str, pdv: Dict[str, Any]) -> str:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10 ** 9,
           "pdv": pdv}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path
