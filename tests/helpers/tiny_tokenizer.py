"""A tiny byte-level BPE tokenizer trained offline and deterministically, with a plain chat template."""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
CORPUS = [
    '{"name": "Ada", "age": 36, "city": "London"}', "order A-12345 amount 129.50 EUR",
    "The quick brown fox jumps over the lazy dog.", "bug billing other yes no true false null",
    "Invoice 2024-03-01 total: 1,234.56", "[1, 2, 3] {\"a\": [true, false]}",
] * 20


def build_tiny_tokenizer(folder: Path, vocab_size: int = 320) -> Path:
    """Train a byte-level BPE (<unk>=0, <s>=1 BOS, </s>=2 EOS) and save tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
