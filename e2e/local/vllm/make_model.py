"""Writes the tiny model every local vLLM engine serves: a Llama with random weights from
a fixed seed, a byte-level BPE tokenizer trained here on the Python standard library's
sources, and a chat template. Nothing is downloaded; the same files on every engine mean
the same weights, so greedy outputs of different engines can be compared token for token.

    python make_model.py OUT_DIR      (run with the real-vLLM runtime's Python)
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

SEED = 0
VOCAB = 2048
MAX_POSITIONS = 2048
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]
# Role markers a chat template needs; plain text, so any prompt tokenizes the same way.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>\n{% endif %}"
)


def training_text() -> list[str]:
    """The stdlib's own .py files in a fixed order: the same text on every machine with
    the same Python, and a few MB is plenty for 2048 tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:200]
    return [str(p) for p in files]


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(training_text(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[1], pad_token=SPECIAL[2],
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_weights(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=MAX_POSITIONS,
        bos_token_id=ids[SPECIAL[0]], eos_token_id=ids[SPECIAL[1]], pad_token_id=ids[SPECIAL[2]],
        tie_word_embeddings=False, torch_dtype="bfloat16",
        # At the usual 0.02 a random Llama repeats one token whatever the prompt; at 0.1
        # its greedy output depends on the whole context, so a lost or wrong KV cache
        # changes what it says.
        initializer_range=0.1,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # vLLM reads the generation defaults; greedy unless a request asks otherwise keeps
    # outputs comparable across engines.
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
         "pad_token_id": config.pad_token_id, "do_sample": False}, indent=2))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    make_weights(out)
    print(out)


if __name__ == "__main__":
    main()
