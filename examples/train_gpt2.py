"""Train GPT-2 on a local text file: TorchAcc's GPT-2 example, plus the two torchacc lines.

    . .venv/bin/activate                                             # torchacc's environment (make setup)
    torchrun --nproc_per_node=2 examples/train_gpt2.py              # 2 ranks, FSDP
    python examples/train_gpt2.py --steps 20                         # one process works too
    torchrun --nproc_per_node=2 examples/train_gpt2.py --model_dir ./my-gpt2   # from_pretrained
    torchrun --nproc_per_node=2 examples/train_gpt2.py --config examples/train_gpt2.yaml memory.gc=true
    torchrun --nproc_per_node=2 examples/train_gpt2.py --save_dir ./shards    # then: torchacc consolidate

The torchacc config comes from the flags (--bf16, --fsdp_size, --log_every, --metrics_dir), then the --config
YAML file, then any KEY=VALUE overrides (docs/config.md lists every key); later wins. --save_dir writes one
shard file per rank, TorchAcc-style, plus the model config and tokenizer; examples/consolidate.sh takes it
from there. Every --log_every steps a metrics line is printed and appended to METRICS_DIR/metrics.jsonl;
at the end the run is plotted to METRICS_DIR/metrics.png (docs/watching.md).

Everything is local: the text is examples/data/tiny_corpus.txt, the tokenizer is trained on it in
a second, and the model is built from a small GPT-2 config (or loaded from ``--model_dir``).
Remove the two marked lines and this is a plain single-process PyTorch script.
"""

import argparse
import math
import os
from pathlib import Path

import datasets
import torch
import transformers
from datasets import load_dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, default_data_collator

import torchacc

HERE = Path(__file__).resolve().parent


def build_tokenizer(text_file: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on the local corpus (no download)."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([text_file], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")


def build_dataset(text_file: str, tokenizer: PreTrainedTokenizerFast, block_size: int):
    raw = load_dataset("text", data_files={"train": text_file})["train"]
    tokenized = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"], desc="tokenize")

    def group_texts(batch):
        ids = [t for row in batch["input_ids"] for t in row + [tokenizer.eos_token_id]]
        n = len(ids) // block_size * block_size
        blocks = [ids[i : i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    lm = tokenized.map(group_texts, batched=True, remove_columns=tokenized.column_names, desc="group into blocks")
    lm.set_format("torch")
    return lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text_file", default=str(HERE / "data" / "tiny_corpus.txt"))
    parser.add_argument("--model_dir", default=None, help="a local directory for from_pretrained")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=8, help="per rank")
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fsdp_size", type=int, default=None, help="default: all ranks")
    parser.add_argument("--config", default=None, help="a torchacc config YAML file, e.g. examples/train_gpt2.yaml")
    parser.add_argument("--save_dir", default=None, help="save per-rank model and optimizer shards here")
    parser.add_argument("--log_every", type=int, default=5, help="a metrics record every N steps (0: off)")
    parser.add_argument("--metrics_dir", default=None, help="metrics.jsonl and metrics.png go here (default: runs)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. memory.gc=true")
    args = parser.parse_intermixed_args()

    if torchacc.dist.rank() != 0:
        # Every rank loads and maps the same text (and from_pretrained's the same weights): rank 0's progress
        # bars say all there is to say. Only the bars: warnings still print on every rank.
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    tokenizer = build_tokenizer(args.text_file)
    if args.model_dir:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    else:
        config = AutoConfig.for_model(
            "gpt2",
            vocab_size=len(tokenizer),
            n_positions=args.block_size,
            n_embd=64,
            n_layer=2,
            n_head=4,
            # GPT-2's default bos/eos (50256) lie outside this tokenizer's small vocabulary: use its own token.
            # No pad_token_id: the blocks are packed, never padded (set to [EOS] it would make every forward
            # warn that the input_ids hold padding and want an attention_mask).
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        model = AutoModelForCausalLM.from_config(config)
    # transformers picks a model's loss by its class name, and "GPT2LMHeadModel" names none: say which one,
    # or the first forward with labels warns `loss_type=None` (and falls back to this same loss).
    model.loss_type = "ForCausalLM"
    dataset = build_dataset(args.text_file, tokenizer, args.block_size)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, collate_fn=default_data_collator
    )

    # --- the two torchacc lines (the config lines only set what this script's flags ask for) ---
    config = torchacc.Config()
    config.compute.bf16 = args.bf16
    config.dist.fsdp.size = args.fsdp_size or torchacc.dist.world_size()
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.metrics.every = args.log_every  # loss, tokens/s, MFU, memory, grad norm: docs/watching.md
    config.metrics.sinks = {"console", "jsonl"}
    config.metrics.dir = args.metrics_dir or config.metrics.dir
    if args.config or args.overrides:  # layered over the flags above: the YAML file, then KEY=VALUE
        files = [f"config={args.config}"] if args.config else []
        config = torchacc.Config.from_cli(files + args.overrides, base=config)
        if torchacc.dist.is_master_ordinal(local=False):
            print(f"torchacc config:\n{config.to_yaml()}")
    model, loader = torchacc.accelerate(model, loader, config)
    # ---------------------------------------------------------------------------------------------

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    losses = []
    bar = tqdm(total=args.steps, disable=torchacc.dist.rank() != 0, desc="train")  # rank 0 draws it for all
    step = 0
    for _epoch in range(math.ceil(args.steps / len(loader))):
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(torchacc.dist.reduce(loss.detach()).item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update()
            step += 1
            if step == args.steps:
                break
    bar.close()
    if torchacc.dist.is_master_ordinal(local=False):
        num_ranks = torchacc.dist.world_size()
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} after {len(losses)} steps on {num_ranks} rank(s)")
        show_metrics(config.metrics)
    if args.save_dir:
        save_shards(model, optimizer, tokenizer, args.save_dir)


def show_metrics(metrics: torchacc.MetricsConfig) -> None:
    """Say where the records are, and plot them (when matplotlib is installed: pip install 'torchacc[plot]')."""
    jsonl = os.path.join(metrics.dir, "metrics.jsonl")
    if not metrics.every or "jsonl" not in metrics.sinks or not os.path.isfile(jsonl):
        return
    print(f"metrics: {jsonl}")
    try:
        print(f"plot: {torchacc.metrics.plot_metrics(metrics.dir)}")
    except ImportError:
        print(f"plot: pip install 'torchacc[plot]', then torchacc plot {metrics.dir}")


def save_shards(model, optimizer, tokenizer, save_dir: str) -> None:
    """TorchAcc-style checkpoint: every rank writes its own shards; `torchacc consolidate` merges them offline."""
    rank, world = torchacc.dist.rank(), torchacc.dist.world_size()
    os.makedirs(save_dir, exist_ok=True)
    meta = model.get_shard_metadata()  # how each tensor is split: all the offline tools need
    model_shard = {"model": model.state_dict(), "shard_metadata": meta}
    torchacc.save(model_shard, f"{save_dir}/rank-{rank}-of-{world}-model.pth", master_only=False)
    optim_shard = {"optimizer": torchacc.optim_state_dict(model, optimizer), "shard_metadata": meta}
    torchacc.save(optim_shard, f"{save_dir}/rank-{rank}-of-{world}-optim.pth", master_only=False)
    if torchacc.dist.is_master_ordinal(local=False):
        model.config.save_pretrained(save_dir)  # config.json: what the Hugging Face export needs
        tokenizer.save_pretrained(save_dir)
        print(f"saved {world} shard file(s) per kind, config.json and the tokenizer to {save_dir}")
    torchacc.dist.rendezvous("shards_saved")


if __name__ == "__main__":
    main()
