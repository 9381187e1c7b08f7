"""N concurrent streamed completions through an OpenAI-compatible server with the official
`openai` async client (not written in this project). Prints one JSON line: streams asked,
streams that ended with finish_reason set, failures (first error), the most streams open at
once (first chunk received, end not yet), wall seconds.

    python bench/streams.py URL STREAMS MAX_TOKENS
"""
import asyncio
import json
import sys
import time

import openai


async def main(url: str, streams: int, max_tokens: int) -> None:
    client = openai.AsyncOpenAI(
        base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=300
    )
    errors: list[str] = []
    open_now = 0
    most_open = 0

    async def one(i: int) -> bool:
        nonlocal open_now, most_open
        opened = False
        try:
            stream = await client.completions.create(
                model="sim-model",
                prompt=f"stream {i}: the quick brown fox jumps over the lazy dog",
                max_tokens=max_tokens,
                stream=True,
            )
            finished = False
            async for chunk in stream:
                if not opened:
                    opened = True
                    open_now += 1
                    most_open = max(most_open, open_now)
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished = True
            return finished
        except Exception as e:  # noqa: BLE001 - counted and reported
            errors.append(f"{type(e).__name__}: {e}")
            return False
        finally:
            if opened:
                open_now -= 1

    t0 = time.monotonic()
    done = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.monotonic() - t0
    await client.close()
    print(json.dumps({"streams": streams, "complete": sum(done), "failed": streams - sum(done),
                      "first_error": errors[0] if errors else None, "most_open": most_open, "wall_s": round(wall, 2)}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
