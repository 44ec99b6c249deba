"""ACLTrainer runs for tests/test_hf.py's torchrun test: the same runs in one process or under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/hf_ddp_worker.py OUT_DIR GLOBAL_BATCH

Each run of RUNS trains the tiny random BERT for a few SGD steps on the toy data in a fixed order
(SequentialSampler), GLOBAL_BATCH samples per step split over the processes, and rank 0 writes
OUT_DIR/<name>.pt with the training logs, the gate decisions and the final parameters.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import SequentialSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_hf import args, tiny_model, toy_dataset  # noqa: E402

from acl_lab.distributed import is_main, shutdown, world_size  # noqa: E402
from acl_lab.hf import ACLTrainer  # noqa: E402

STEPS = 3
# name -> ACLTrainer keyword arguments
RUNS = {
    "acl": dict(objective="acl", threshold=55.0),  # thresholds chosen so that some batches are dropped
    "acl-repr": dict(objective="acl", scope="repr"),
    "acl-head": dict(objective="acl", scope="head"),
    "ce+scl-gated": dict(objective="ce+scl", acl_grad=True, threshold=70.0),
    "acl-embed": dict(objective="acl-embed"),
}


class OrderedACLTrainer(ACLTrainer):
    """The same batches in one process and in several: no shuffling."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


def run(name: str, out: Path, global_batch: int) -> dict:
    """Train run ``name``; return (and on rank 0 save) its logs, gate history and parameters."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # the Trainer starts the process group only later
    per_device = global_batch // processes
    model = tiny_model("bert", initializer_range=0.2)  # wider init: CE gradients well above rounding at step 1
    trainer = OrderedACLTrainer(model=model, args=args(out / name, per_device_train_batch_size=per_device,
                                                       max_steps=STEPS, optim="sgd", learning_rate=0.05),
                                train_dataset=toy_dataset(), lam=0.5, temperature=0.2, **RUNS[name])
    trainer.train()
    result = {"logs": [r for r in trainer.state.log_history if "loss" in r], "gate": trainer.gate_history,
              "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
              "world_size": world_size()}
    if is_main():
        torch.save(result, out / f"{name}.pt")
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir, batch = Path(sys.argv[1]), int(sys.argv[2])
    me = os.environ.get("RANK", "0")  # read once: after shutdown() the process group can no longer say
    for run_name in RUNS:
        run(run_name, out_dir, batch)
        print(f"[hf_ddp_worker] rank {me}: {run_name} done", file=sys.stderr, flush=True)
    # Leave together and free the group while the interpreter is whole (acl_lab.distributed.shutdown): without it
    # gloo's threads can abort a rank at exit ("terminate called without an active exception", exit -6). The
    # progress lines say, when a launch fails, how far each rank got.
    shutdown()
    print(f"[hf_ddp_worker] rank {me}: left the process group", file=sys.stderr, flush=True)
