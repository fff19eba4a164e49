"""`python -m services.scheduler.inspect`: which workers hold how much of a prompt's prefix, per the global
index in Redis (the same one-round-trip lookup the scheduler routes with).

    python -m services.scheduler.inspect --redis-url unix:///tmp/r.sock --model-id smollm2-135m-instruct \\
        --prompt-ids 1,2,3,...          (or --text "..." --tokenizer-dir DIR)
"""
from __future__ import annotations

import argparse
import asyncio
import sys

import redis.asyncio as aioredis

from shared import redis_index
from shared.hashing import hash_blocks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler.inspect", description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", required=True, help="the index's Redis (redis://host:port/db or unix:///path)")
    parser.add_argument("--model-id", required=True, help="the model id that salts the block hashes")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per block")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", help="the prompt as comma-separated token ids")
    prompt.add_argument("--text", help="the prompt as text (needs --tokenizer-dir; encoded as a completion)")
    parser.add_argument("--tokenizer-dir", help="a Hugging Face tokenizer directory for --text")
    args = parser.parse_args(argv)
    if args.text is not None and not args.tokenizer_dir:
        parser.error("--text needs --tokenizer-dir")
    if args.page_size < 1:
        parser.error("--page-size must be >= 1")
    return args


def prompt_ids(args: argparse.Namespace) -> list[int]:
    if args.prompt_ids is not None:
        return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    import transformers

    return list(transformers.AutoTokenizer.from_pretrained(args.tokenizer_dir).encode(args.text))


async def holders(redis_url: str, block_hashes: list[int]) -> dict[str, int]:
    client = aioredis.from_url(redis_url)
    try:
        return await redis_index.longest_prefix(client, block_hashes)
    finally:
        await client.aclose()


def report(ids: list[int], page_size: int, held: dict[str, int]) -> str:
    """One line for the prompt, then one per worker holding its first block, longest prefix first."""
    num_blocks = len(ids) // page_size
    lines = [f"prompt: {len(ids)} tokens, {num_blocks} full blocks of {page_size}"]
    for worker_id, num_held in sorted(held.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"{worker_id}\t{num_held}/{num_blocks} blocks\t{num_held * page_size} tokens cached")
    if not held:
        lines.append("no worker holds the first block")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ids = prompt_ids(args)
    held = asyncio.run(holders(args.redis_url, hash_blocks(ids, args.page_size, args.model_id)))
    print(report(ids, args.page_size, held))
    return 0


if __name__ == "__main__":
    sys.exit(main())
