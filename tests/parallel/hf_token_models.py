"""Hugging Face token classifiers with tiny configs (random init, offline), as a user brings them:
GPT-2 (a causal mask built from the shapes it reads, the last non-pad token's logits picked with
`logits[arange(batch), last_non_pad]`; not torch.fx-traceable) and BERT (attention over a padding
mask). `gpt2()` / `bert()` are factories for `hybridpar train --model this_file.py:gpt2`."""

from __future__ import annotations

import os

import torch


def build(kind: str):
    """(module returning logits, token ids [4, 12] with one padded row, labels)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4, num_labels=10,
                            pad_token_id=0, bos_token_id=1, eos_token_id=1, attn_implementation="eager",
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        net = tf.GPT2ForSequenceClassification(cfg)
    else:
        cfg = tf.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=16, num_labels=10,
                            attn_implementation="eager", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        net = tf.BertForSequenceClassification(cfg)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, ids):
            return self.net(input_ids=ids).logits

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 96, (4, 12), generator=g)
    ids[1, 9:] = 0  # a padded row: GPT-2 classifies its last non-pad token
    return Logits(), ids, torch.randint(0, 10, (4,), generator=g)


def gpt2():
    model, ids, _ = build("gpt2")
    return model, (ids,)


def bert():
    model, ids, _ = build("bert")
    return model, (ids,)
