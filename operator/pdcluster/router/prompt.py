"""What the router (and the engine simulator) know about a prompt without a tokenizer.

The router only needs token counts for load accounting and prefix-block hashes for
cache affinity, so it approximates instead of loading the model's tokenizer:

- text counts as ceil(UTF-8 bytes / 4) tokens: English BPE vocabularies (Llama 3,
  GPT-4) average about 4 characters per token, which is close enough to balance load;
- a prompt given as token ids (a list of ints) counts exactly;
- a chat request is rendered as "role\\ncontent\\n" per message (text parts of list
  contents joined) and counted like text; the template overhead is a few tokens.

Prefix blocks are chained hashes: block i's hash covers block i and all blocks before
it, so equal hashes at equal positions mean a shared prefix (the same idea as vLLM's
prefix cache and the `hash_ids` of the Mooncake traces). Text blocks are BLOCK_TOKENS
approximate tokens (4 * BLOCK_TOKENS bytes); token-id prompts use BLOCK_TOKENS ids.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Any

BYTES_PER_TOKEN = 4
BLOCK_TOKENS = 64
_BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN
_LOW7 = bytes(b & 0x7F for b in range(256))


def text_tokens(text: str) -> int:
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-size // BYTES_PER_TOKEN)


def chat_text(messages: list[Any]) -> str:
    """The text the router counts for a chat request. Assumes validated messages."""
    parts: list[str] = []
    for message in messages:
        parts.append(message.get("role", ""))
        parts.append("\n")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        parts.append("\n")
    return "".join(parts)


def prompt_of(body: dict[str, Any], chat: bool) -> str | list[int]:
    """The prompt as text or token ids. Assumes a validated body (see router.validate)."""
    if chat:
        return chat_text(body["messages"])
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    return prompt


def count_tokens(prompt: str | list[int]) -> int:
    return text_tokens(prompt) if isinstance(prompt, str) else len(prompt)


def token_ids(prompt: str | list[int]) -> list[int]:
    """The engine simulator's tokenizer: one id per BYTES_PER_TOKEN bytes of UTF-8 (their
    low 31 bits), so it agrees with `count_tokens` and a shared text prefix is a shared
    token prefix."""
    if not isinstance(prompt, str):
        return list(prompt)
    data = bytearray(prompt.encode("utf-8", "surrogatepass"))
    data += b"\0" * (-len(data) % BYTES_PER_TOKEN)
    data[3::4] = data[3::4].translate(_LOW7)  # 31-bit ids, as a vocabulary's fit an int32
    ids = array("I", data)  # little-endian 4-byte words
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def block_hashes(prompt: str | list[int]) -> list[int]:
    """Chained hashes of the prompt's full and final partial blocks."""
    if isinstance(prompt, str):
        data = prompt.encode("utf-8", "surrogatepass")
        step = _BLOCK_BYTES
    else:
        ids = array("q", prompt)
        data = ids.tobytes()
        step = BLOCK_TOKENS * ids.itemsize
    running = hashlib.blake2b(digest_size=8)
    out: list[int] = []
    for start in range(0, len(data), step):
        running.update(data[start : start + step])
        out.append(int.from_bytes(running.digest(), "little"))
    return out
