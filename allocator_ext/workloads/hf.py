"""Hugging Face transformers, models built from configurations (no weights are downloaded):
`generate` with a growing KV cache (`kv_generate`), and fine-tuning with gradient checkpointing
on dynamically padded batches (`trainer`)."""

from __future__ import annotations

import random
from typing import Any

import torch

from allocator_ext.workloads.base import Batch, Workload, autocast, generator, train_step


class KVGenerate(Workload):
    """A Llama model's `generate`: greedy decoding of a random number of new tokens (every one
    of them: end-of-sequence is held off until the last) after random prompts of one random
    length, a random batch of them. transformers' cache grows by concatenation at every token,
    in every layer."""

    name = "kv_generate"

    def __init__(self, device: torch.device, tiny: bool, seed: int) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        # transformers' own annotations differ between its releases: the model as Any.
        make_config: Any = LlamaConfig
        if tiny:
            config = make_config(vocab_size=128, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, max_position_embeddings=64)
            self.batch, self.prompt, self.new_tokens = (1, 3), (4, 12), (2, 4)
        else:
            config = make_config(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                 num_hidden_layers=4, num_attention_heads=16,
                                 num_key_value_heads=16, max_position_embeddings=1024)
            self.batch, self.prompt, self.new_tokens = (1, 16), (32, 512), (8, 48)
        self.vocab = config.vocab_size
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        with torch.device(device):  # built where it runs: no copy of its weights on the host
            model: Any = LlamaForCausalLM(config)
        model = model.to(dtype).eval()
        super().__init__(model, device, random.Random(seed))

    def draw(self, largest: bool = False) -> Batch:
        batch = self._pick(self.batch, largest)
        prompt = self._pick(self.prompt, largest)
        new_tokens = self._pick(self.new_tokens, largest)
        g = generator(self.device, self._value_seed(largest))
        tokens = torch.randint(1, self.vocab, (batch, prompt), generator=g, device=self.device)
        return tokens, new_tokens

    @torch.no_grad()
    def run(self, batch: Batch) -> None:
        tokens, new_tokens = batch
        model: Any = self.model
        model.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens),
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0, use_cache=True)


def padding_tokenizer() -> Any:
    """A fast tokenizer that knows only its padding and unknown tokens: what
    DataCollatorWithPadding needs to pad token ids that are already drawn (a real vocabulary
    would be downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]")),
        pad_token="[PAD]", unk_token="[UNK]")


class TrainerStep(Workload):
    """A BERT classifier fine-tuned as Hugging Face's Trainer does it, one step at a time:
    examples of random lengths (each batch draws its longest length, then each example its
    own below it, as real text's lengths are skewed), padded by DataCollatorWithPadding to the
    batch's longest (a multiple of 8), gradient checkpointing on every layer, bf16 autocast,
    AdamW."""

    name = "trainer"

    def __init__(self, device: torch.device, tiny: bool, seed: int) -> None:
        from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding

        make_config: Any = BertConfig
        if tiny:
            config = make_config(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64,
                                 max_position_embeddings=64, num_labels=3)
            self.batch, self.longest = (2, 4), (8, 24)
        else:
            config = make_config(vocab_size=30522, hidden_size=768, num_hidden_layers=8,
                                 num_attention_heads=12, intermediate_size=3072,
                                 max_position_embeddings=512, num_labels=4)
            self.batch, self.longest = (8, 32), (32, 512)
        self.vocab, self.labels = config.vocab_size, config.num_labels
        with torch.device(device):
            model: Any = BertForSequenceClassification(config)
        # transformers 5 renamed gradient checkpointing to activation checkpointing.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        super().__init__(model.train(), device, random.Random(seed))
        self.collator = DataCollatorWithPadding(padding_tokenizer(), pad_to_multiple_of=8,
                                                return_tensors="pt")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-5)

    def draw(self, largest: bool = False) -> Batch:
        count = self._pick(self.batch, largest)
        longest = self._pick(self.longest, largest)
        lengths = [longest if largest or self.fixed_shapes else self.rng.randint(4, longest)
                   for _ in range(count)]
        g = torch.Generator().manual_seed(self._value_seed(largest))
        ids = torch.randint(2, self.vocab, (count, longest), generator=g).tolist()
        labels = torch.randint(0, self.labels, (count,), generator=g).tolist()
        features = [{"input_ids": row[:n], "label": label}
                    for row, n, label in zip(ids, lengths, labels, strict=True)]
        padded = self.collator(features)
        return tuple(padded[k].to(self.device) for k in ("input_ids", "attention_mask",
                                                        "labels"))

    def run(self, batch: Batch) -> None:
        input_ids, attention_mask, labels = batch
        with autocast(self.device):
            loss = self.model(input_ids=input_ids, attention_mask=attention_mask,
                              labels=labels).loss
        train_step(self, loss)


def build(name: str, device: torch.device, tiny: bool, seed: int) -> Workload:
    if name == "kv_generate":
        return KVGenerate(device, tiny, seed)
    assert name == "trainer", name
    return TrainerStep(device, tiny, seed)
