"""What the demos need of a tokenizer: the training text, the prompt, decoding. A model folder without
tokenizer files (trainers' checkpoints often have none) gets token ids drawn from the vocabulary instead, the
same in every process (:func:`mxport.models.vocabulary_prompts`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import vocabulary_prompts

TEXT = ("Mixed precision training keeps master weights in high precision while the inference engine runs in "
        "low precision. After every optimizer step the new weights are quantized to MXFP8, eight-bit values "
        "with one shared power-of-two scale for every block of thirty-two elements, and sent to the engine.")
PROMPT = "Explain in one sentence why the sky is blue."
#: the seed of the training batch drawn without a tokenizer (the prompt uses vocabulary_prompts' own)
BATCH_SEED = 1


@dataclass(frozen=True)
class Words:
    """A model's tokenizer (``tok``), or None: then ids drawn from ``vocab``."""

    tok: object | None
    vocab: int

    @classmethod
    def of(cls, model, tok) -> Words:
        return cls(tok, int(model.config.vocab_size))

    def batch(self, seq_len: int) -> dict[str, torch.Tensor]:
        """The training batch: :data:`TEXT`, or ``seq_len`` ids drawn from the vocabulary."""
        if self.tok is None:
            ids = vocabulary_prompts(self.vocab, 1, length=seq_len, seed=BATCH_SEED)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return dict(self.tok(TEXT, return_tensors="pt", truncation=True, max_length=seq_len))

    def prompt(self) -> torch.Tensor:
        """``[1, n]`` ids: :data:`PROMPT` in the chat template where there is one, else ids from the vocab."""
        if self.tok is None:
            return vocabulary_prompts(self.vocab)
        text = PROMPT
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                add_generation_prompt=True)
        return self.tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]

    def decode(self, ids: torch.Tensor) -> str:
        if self.tok is None:
            return "token ids " + " ".join(str(int(i)) for i in ids)
        return self.tok.decode(ids, skip_special_tokens=True)

    def generate_kwargs(self, model) -> dict:
        """``pad_token_id`` / ``eos_token_id`` for ``model.generate``: the tokenizer's, else the model's
        generation config's (0 for padding where it has none)."""
        if self.tok is not None:
            return {"pad_token_id": self.tok.pad_token_id, "eos_token_id": self.tok.eos_token_id}
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        pad = getattr(gen, "pad_token_id", None)
        return {"pad_token_id": pad if pad is not None else (eos if isinstance(eos, int) else 0),
                "eos_token_id": eos}
