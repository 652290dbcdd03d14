"""The plan path on the demo GPT: single-device code, a plan naming a few weights, the
compiler places the rest and explains its choice.

    torchrun --standalone --nproc-per-node 4 examples/plan_gpt.py [--device cpu|cuda]    (a (dp=2, tp=2) mesh)

It prints the loss of each of 3 steps, the explanation's summary (the program chosen and its
estimated cost) and the placements of the first block and the head. The tokens are random
(``gpt.batch``, a vocabulary of 1024 here), so the loss stays near ``ln(1024) = 6.93``;
``tests/plan/test_gpt_plan.py`` checks that this plan trains like one device.
"""

from __future__ import annotations

import argparse
import os

import gpt
import torch
import torch.distributed as dist
from launch import add_device_argument, init_distributed

import vescale
from vescale import Replicate, Shard

PLAN = {  # only the linear weights, the embeddings and the head
    "blocks.*.attn.[qkv].weight": {"tp": Shard(0)},
    "blocks.*.mlp.fc.weight": {"tp": Shard(0)},
    "blocks.*.*.proj.weight": {"tp": Shard(1)},
    "tok.weight": (Replicate(), Replicate()),
    "pos.weight": (Replicate(), Replicate()),
    "head.weight": {"tp": Shard(0)},
}
BATCH = {"dp": Shard(0)}  # token ids and targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    device = init_distributed(parser.parse_args().device)
    mesh = vescale.init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = gpt.GPTConfig(vocab=1024)
    example = gpt.batch(cfg, 0, device=device)
    model = vescale.parallelize(
        gpt.build(cfg, device=device), mesh, PLAN, inputs=[BATCH, BATCH], example_inputs=example
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(*gpt.batch(cfg, step, device=device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.full_tensor().item():.4f}")
    if dist.get_rank() == 0:
        explanation = model.explain()
        print(explanation.summary())
        for name, p in model.module.named_parameters():
            if name.startswith(("blocks.0.", "head")):
                print(f"{name:28s} {tuple(p.placements)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
