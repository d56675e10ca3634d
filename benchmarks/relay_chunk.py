"""CPU the router's stream relay spends on one engine chunk, in-process (no sockets):
resume.TokenTrail.relay (token ids taken out and kept) and the event counting the relay
does for its TTFT/ITL metrics, on a 64-token completion stream in one chunk with a
450-token prompt's ids in its first event (vLLM's shape with `return_token_ids`).

    .venv/bin/python benchmarks/relay_chunk.py [--tokens 64] [--prompt 450] [--rounds 2000]
"""

from __future__ import annotations

import argparse
import time

import orjson

from pdcluster.router.resume import TokenTrail


def chunk(tokens: int, prompt: int) -> bytes:
    events = []
    for i in range(tokens):
        choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": None, "stop_reason": None,
                  "token_ids": [1000 + i], "prompt_token_ids": list(range(prompt)) if i == 0 else None}  # fmt: skip
        body = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
        events.append(b"data: " + orjson.dumps(body) + b"\n\n")
    return b"".join(events) + b"data: [DONE]\n\n"


def per_call_us(fn, rounds: int) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - started) / rounds * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=450)
    p.add_argument("--rounds", type=int, default=2000)
    args = p.parse_args()
    data = chunk(args.tokens, args.prompt)

    def count() -> None:
        for marker in (b"data: ", b'{"role":', b'"choices":[]', b"data: [DONE]"):
            data.count(marker)

    relay = per_call_us(lambda: TokenTrail(client_wants_ids=False).relay(data), args.rounds)
    counting = per_call_us(count, args.rounds)
    print(
        f"{args.tokens}-token chunk, {len(data)} bytes: relay {relay:.0f} us, event counting {counting:.0f} us"
    )


if __name__ == "__main__":
    main()
