"""One training step of a causal LM with ring attention over a CP group, against the same step in one process.

    torchrun --nproc_per_node 2 examples/ring_model_cpu.py
    torchrun --nproc_per_node 4 examples/ring_model_cpu.py --seq 4099

Every process builds the same tiny Llama from a config (no download) and the same batch, then:

1. ``hf_ring.setup_context_parallel(cp_size)``: all processes form one CP group (it starts the process
   group: gloo on CPU, NCCL with CUDA; and ends it when the script exits);
2. ``hf_ring.shard_batch(batch)``: this rank's zigzag shard of the tokens, labels shifted first;
3. forward and backward with ``attn_implementation="ring"``: the loss is the whole sequence's on every rank,
   each rank's gradients cover the tokens it holds;
4. the gradients averaged over the CP group (``all_reduce``, then divided by the group's size: what DDP or
   FSDP does across the ranks, and ``RingTrainer`` in a real run);
5. one optimizer step.

It then runs the same step in this process on the whole sequence with ``attn_implementation="sdpa"`` and
checks that the loss, every gradient and every updated weight agree (float32: the loss within 1e-5 of itself,
gradients within 2e-5 of each parameter's largest). Prints one line per rank; exits 1 if they do not agree.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_ring

VOCAB = 256


def tiny_llama(attn: str, device: torch.device) -> torch.nn.Module:
    """The same random tiny Llama in every process (seeded), with ``attn`` as its attention."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).to(device)


def average_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Average every gradient over ``group``: each rank's covers only its shard of the sequence."""
    size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= size


def train_step(model: torch.nn.Module, batch: dict, lr: float, group: dist.ProcessGroup | None) -> tuple:
    """Forward, backward, gradients averaged over ``group`` (if any), one SGD step: ``(loss, gradients)``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = model(**batch).loss
    loss.backward()
    if group is not None:
        average_gradients(model, group)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    return loss.item(), grads


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=1001, help="tokens in the sequence (any length: shard_batch pads)")
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()

    cp = hf_ring.setup_context_parallel(cp_size=int(os.environ.get("WORLD_SIZE", "1")))  # one CP group of all
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    ids = torch.randint(0, VOCAB, (1, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    batch = {"input_ids": ids, "labels": ids}  # the same full batch on every rank: [B, N], labels unshifted

    ring = tiny_llama("ring", device)
    loss, grads = train_step(ring, hf_ring.shard_batch(batch), args.lr, cp.cp_group)

    one = tiny_llama("sdpa", device)  # the same step, the whole sequence in this process
    want_loss, want_grads = train_step(one, batch, args.lr, None)

    grad_err = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)) for n, g in want_grads.items())
    with torch.no_grad():
        weight_err = max(float((a - b).abs().max()) for a, b in zip(ring.parameters(), one.parameters()))
        # each weight moved by lr * gradient: the gradients' difference, plus a rounding of the weight itself
        weight_tol = 2e-5 * args.lr * max(float(g.abs().max()) for g in want_grads.values()) + 2 * torch.finfo(
            torch.float32).eps * max(float(w.abs().max()) for w in one.parameters())  # fmt: skip
    ok = abs(loss - want_loss) <= 1e-5 * abs(want_loss) and grad_err <= 2e-5 and weight_err <= weight_tol
    print(f"rank {cp.cp_rank}/{cp.cp_size}: N={args.seq}, loss {loss:.6f} vs one process {want_loss:.6f}; gradients "
          f"within {grad_err:.1e} of each parameter's largest; weights after the step within {weight_err:.1e}: "
          f"{'agree' if ok else 'DIFFER'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
