"""Tiny models and data shared by the tests (nothing is downloaded)."""

import torch
import torch.nn as nn

VOCAB = 128
SEQ = 16


def tiny_gpt2(seed: int = 0, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        # GPT-2's default bos/eos (50256) lie outside VOCAB, and transformers warns at every build; no test
        # generates text, so the last token is as good as any.
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**cfg))


def token_dataset(num_samples: int = 32, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Samples whose next token is a simple function of the current one, so the loss can fall."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (num_samples, 1), generator=gen)
    ids = (start + 3 * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row.clone(), "index": torch.tensor(i)} for i, row in enumerate(ids)]


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.num_forward_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.num_forward_calls += 1
        return x + self.fc2(torch.relu(self.fc1(x)))


class PureBlock(Block):
    """A ``Block`` without the call counter, for compiled runs: inside activation checkpointing, dynamo cannot
    trace a Python side effect (the counter), gives up on the whole block and leaves it eager."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class TinyNet(nn.Module):
    def __init__(self, dim: int = 16, num_blocks: int = 3, *, block_cls: type[Block] = Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block_cls(dim) for _ in range(num_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# The sizes of every tiny decoder: 2 layers, 4 query and 2 key/value heads of 16 dimensions, hidden size 64.
DECODER_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
)
TINY_DECODER = dict(
    **DECODER_SIZES,
    bos_token_id=VOCAB - 1,
    eos_token_id=VOCAB - 1,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def tiny_llama(seed: int = 0, kind: str = "llama", **overrides):
    """A 2-layer Llama-style decoder (``kind``: "llama" or "qwen2"), 4 query and 2 key/value heads: its tensor-
    parallel plan (``model.tp_plan``) comes with the model."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    cfg = dict(TINY_DECODER)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**cfg))


# Decoder families for the tensor-parallel tests: (config class, model class, settings beyond tiny_llama's).
DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    # partial rotary, a "dense" output layer, fc1/fc2, and LayerNorms over head_dim inside the attention
    "phi": ("PhiConfig", "PhiForCausalLM", {"qk_layernorm": True, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    # packed layers: self_attn.qkv_proj and mlp.gate_up_proj
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    # query_key_value: q, k and v fused, grouped per head
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"hidden_dropout": 0.0, "attention_dropout": 0.0}),
    # scales the embeddings in the decoder's forward and the logits after the head
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 3.0, "logits_scaling": 5.0}),
    # q_norm and k_norm over the whole projected width (not per head); its own plan gathers q, k and v
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # use_qk_norm=True (Command R+): q_norm and k_norm hold one weight per head, shape (heads, head_dim)
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
}


def tiny_decoder(family: str, seed: int = 0, **overrides):
    """A 2-layer decoder of ``family`` (a key of ``DECODERS``) with tiny_llama's sizes: 4 query and 2 key/value
    heads of 16 dimensions, hidden size 64, vocabulary ``VOCAB``."""
    import transformers

    config_name, model_name, extra = DECODERS[family]
    cfg = dict(TINY_DECODER)
    cfg.update(extra)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg))
