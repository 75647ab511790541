"""Reload an exported Hugging Face directory with transformers and generate a few tokens.

    python examples/generate.py OUT/hf --tokenizer OUT/shards --check OUT/shards/consolidated.pth

The last step of examples/consolidate.sh: ``AutoModelForCausalLM.from_pretrained`` reads what
``torchacc consolidate --format hf`` wrote. With ``--check``, the model's logits are compared with a
model built from the same config and loaded from the consolidated ``.pth`` file: both files come from
the same shards, so they must agree exactly.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", help="a directory written by `torchacc consolidate --format hf`")
    parser.add_argument("--tokenizer", default=None, help="the tokenizer's directory (default: hf_dir)")
    parser.add_argument("--prompt", default="the")
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--check", default=None, help="a consolidated .pth file the weights must equal")
    args = parser.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.hf_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.hf_dir)
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(
            input_ids, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    print(f"generated: {tokenizer.decode(output[0])!r}")

    if args.check:
        reference = AutoModelForCausalLM.from_config(model.config).eval()
        reference.load_state_dict(torch.load(args.check, weights_only=True)["model"])
        with torch.no_grad():
            same = torch.equal(model(output).logits, reference(output).logits)
        print(f"logits {'match' if same else 'DIFFER from'} {args.check}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
