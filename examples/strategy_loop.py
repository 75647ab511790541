"""A training loop written only against torchacc.FSDP2Strategy (the API frameworks build on).

    torchrun --nproc_per_node=2 examples/strategy_loop.py --out /tmp/strategy-run
    torchrun --nproc_per_node=2 examples/strategy_loop.py --out /tmp/strategy-run   # resumes from the latest save

Builds GPT-2 on the meta device (each rank allocates only its shards), trains with gradient
accumulation and clipping, validates, saves rotating sharded checkpoints, resumes from the latest
one when started again, and writes a Hugging Face directory at the end. Every step's metrics (loss,
tokens/s, memory, grad norm; docs/watching.md) and the validation loss go to OUT/metrics/metrics.jsonl:
``torchacc plot OUT/metrics`` draws them, the resumed run beside the first.
"""

import argparse
import os

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import torchacc


class CountingSequences(Dataset):
    """Token sequences that count up by a fixed stride: a pattern a tiny GPT-2 learns in a few steps."""

    def __init__(self, num_samples: int, seq_len: int, vocab: int, offset: int = 0) -> None:
        gen = torch.Generator().manual_seed(offset)
        self.starts = torch.randint(0, vocab, (num_samples,), generator=gen)
        self.seq_len, self.vocab = seq_len, vocab

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (self.starts[i] + 3 * torch.arange(self.seq_len)) % self.vocab
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="checkpoints go to OUT/ckpt, the final model to OUT/hf")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps in this run")
    parser.add_argument("--micro_batch", type=int, default=4, help="samples per rank per forward")
    parser.add_argument("--train_batch", type=int, default=16, help="samples per optimizer step, all ranks")
    args = parser.parse_args()

    strategy = torchacc.FSDP2Strategy(
        sharding_strategy="FULL_SHARD",
        micro_train_batch_size=args.micro_batch,
        train_batch_size=args.train_batch,
        max_norm=1.0,
        seed=0,
    )
    strategy.config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    strategy.config.metrics.every = 1  # a record every optimizer step, written to OUT/metrics/metrics.jsonl
    strategy.config.metrics.sinks = {"jsonl"}
    strategy.config.metrics.dir = os.path.join(args.out, "metrics")
    strategy.setup_environment()

    # The counting sequences have no special tokens; GPT-2's default bos/eos (50256) lie outside this vocabulary.
    config = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
    )
    with strategy.init_model_context():  # parameters on the meta device: no rank holds the full model
        model = GPT2LMHeadModel(config)
    # transformers picks a model's loss by its class name, and "GPT2LMHeadModel" names none: say which one,
    # or the first forward with labels warns `loss_type=None` (and falls back to this same loss).
    model.loss_type = "ForCausalLM"
    model = strategy.parallelize(model)
    optimizer = strategy.create_optimizer(model, lr=3e-3, weight_decay=0.01)
    train_loader = strategy.process_dataloader(
        DataLoader(CountingSequences(512, 32, 128), batch_size=args.micro_batch, shuffle=True)
    )
    val_batch = CountingSequences(8, 32, 128, offset=1)[0]

    ckpt_dir = os.path.join(args.out, "ckpt")
    resumed, client_state = strategy.load_ckpt(model, ckpt_dir, optimizer=optimizer)
    if strategy.is_global_zero:
        print(f"resumed from {os.path.basename(resumed)}" if resumed else "starting from scratch")

    start = strategy.global_step
    batch_idx = 0
    while strategy.global_step < start + args.steps:
        for batch in train_loader:
            loss = strategy.training_step(batch, batch_idx)
            strategy.backward(loss, model, optimizer)
            norm = strategy.optimizer_step(optimizer, model)
            batch_idx += 1
            if norm is None:
                continue
            val = strategy.validation_step(
                {k: v.unsqueeze(0).to(strategy.root_device) for k, v in val_batch.items()}, 0
            )
            train_loss, val_loss = strategy.reduce(loss.detach()).item(), strategy.reduce(val).item()
            torchacc.log_metrics({"val_loss": val_loss}, step=strategy.global_step)  # beside the step's record
            if strategy.is_global_zero:
                print(f"step {strategy.global_step} loss {train_loss:.3f} val {val_loss:.3f} grad_norm {norm:.3f}")
            strategy.save_ckpt(model, ckpt_dir, max_num=2, client_state={"val_loss": val_loss}, optimizer=optimizer)
            if strategy.global_step >= start + args.steps:
                break

    strategy.save_model(model, None, os.path.join(args.out, "hf"))
    if strategy.is_global_zero:
        kept = sorted(name for name in os.listdir(ckpt_dir) if not name.startswith("."))  # not the writer's claim
        print(f"done at step {strategy.global_step}; checkpoints: {kept}")
        metrics_dir = strategy.config.metrics.dir
        print(f"metrics: {os.path.join(metrics_dir, 'metrics.jsonl')} (plot: torchacc plot {metrics_dir})")
    strategy.teardown()


if __name__ == "__main__":
    main()
