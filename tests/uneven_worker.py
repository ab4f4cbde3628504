"""Run by tests/test_distributed.py under ``accelerate launch`` (2 processes on the CPU). The processes hold
episodes of different shapes: rank 1's prompts share a long opening and one of its responses is long (on
one process that makes a training pass encode the opening once and cut the responses into passes by
length), rank 0's do neither. They run different numbers of no-grad forwards (reference passes), then one
training pass each through ``Policy.logprobs`` (of different numbers of forwards) and a backward; writes
each rank's synchronised gradient and how many forwards its training pass ran (the DDP module's forwards and
the lean passes over text responses, which call its layers directly)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from mmgrpo.model import lean_pass
from mmgrpo.model.batch import TokenBatch, VisionInputs
from mmgrpo.model.policy import Policy
from mmgrpo.train.builders import make_accelerator


def batch_of(rank: int) -> TokenBatch:
    g = torch.Generator().manual_seed(rank)
    N, G, P = 16, 4, 24
    prompts = torch.randint(20, 400, (N // G, P), generator=g)  # (B, P)
    if rank == 1:
        prompts[:, :20] = prompts[0, :20]  # a common opening of 20 tokens
    lengths = [4] * (N - 1) + ([100] if rank == 1 else [4])
    T = max(lengths)
    response = torch.randint(20, 400, (N, T), generator=g)  # (N, T)
    rmask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()  # (N, T)
    rows = [i // G for i in range(N)]
    return TokenBatch(
        prompts[rows], torch.ones(N, P, dtype=torch.long), response, rmask, rmask, VisionInputs.none(N // G),
        prompt_index=rows,
    )


def main(model_dir: str, out: Path) -> None:
    acc = make_accelerator(cpu=True, mixed_precision="no", log_with=[], project_dir=out)
    policy = Policy.from_pretrained(model_dir)
    policy.freeze_vision()  # text-only inputs: the tower would be unused, as in the demos it is frozen
    policy.model = acc.prepare(policy.model)
    tok = batch_of(acc.process_index)
    with torch.no_grad():
        for _ in range(1 + 2 * acc.process_index):  # rank 0: one no-grad pass; rank 1: three
            policy.logprobs(tok)
    forwards = []
    policy.model.register_forward_pre_hook(lambda *_: forwards.append(1))  # the DDP module's forwards
    lean_hidden = lean_pass.LeanPass.hidden

    def counted(self, *args):  # a text-only response pass runs the layers outside the DDP module's forward
        forwards.append(1)
        return lean_hidden(self, *args)

    lean_pass.LeanPass.hidden = counted
    lp = policy.logprobs(tok)  # (N, T) the training pass
    (lp * tok.loss_mask).sum().backward()
    grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
    result = {"norm": float(grad.norm()), "first": grad[:64].tolist(), "training_forwards": len(forwards)}
    (out / f"grad{acc.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
