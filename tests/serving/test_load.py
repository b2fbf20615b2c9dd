"""50 concurrent streaming clients against a server with a small KV pool (a typical run preempts ~16 times):
15 hang up mid-stream and 5 give up on a non-streamed request. Afterwards the server is healthy, the clients
that stayed got complete streams, every disconnect was counted as an abort, and every KV block is free."""

from __future__ import annotations

import asyncio
import json

import httpx
from live_server import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_CLIENTS = 50
NUM_HANGUPS = 15  # streaming clients that close the connection after a few chunks
NUM_TIMEOUTS = 5  # non-streaming clients whose read timeout fires long before their completion


async def _stream(client: httpx.AsyncClient, i: int, hang_up: bool) -> tuple[int, bool]:
    """Returns (tokens received, saw [DONE])."""
    body = {"model": MODEL, "prompt": f"Client {i} says", "stream": True, "ignore_eos": True,
            "max_tokens": 400 if hang_up else 24, "temperature": 0.8, "seed": i}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return tokens, True
            tokens += 1 if json.loads(line[6:])["choices"][0]["text"] else 0
            if hang_up and tokens >= 3:
                return tokens, False  # leaving the block closes the connection mid-stream
    return tokens, False


async def _give_up(client: httpx.AsyncClient, i: int) -> None:
    body = {"model": MODEL, "prompt": f"Patient client {i}", "max_tokens": 450, "ignore_eos": True}
    try:
        await client.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        raise AssertionError("a 450-token completion under load should outlast a 0.5 s read timeout")
    except httpx.ReadTimeout:
        pass  # the client hangs up; the server must notice and abort


async def _run_clients(base_url: str) -> list:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + NUM_TIMEOUTS)
    async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=120, limits=limits) as client:
        jobs = [_stream(client, i, hang_up=i < NUM_HANGUPS) for i in range(NUM_CLIENTS)]
        jobs += [_give_up(client, i) for i in range(NUM_TIMEOUTS)]
        return await asyncio.gather(*jobs)


def test_50_streaming_clients_with_disconnects(server):
    before = server.wait_idle()
    results = asyncio.run(_run_clients(server.base_url))[:NUM_CLIENTS]
    for i, (tokens, done) in enumerate(results):
        if i < NUM_HANGUPS:
            assert not done and tokens == 3
        else:
            assert done, f"client {i} did not get [DONE]"
    after = server.wait_idle()
    assert after["trtopt_kv_blocks_used"] == 0
    assert after["trtopt_kv_blocks_free"] == after["trtopt_kv_blocks_total"]
    disconnected = sum(after.get(f'trtopt_requests_total{{endpoint="completions",outcome="{o}"}}', 0)
                       - before.get(f'trtopt_requests_total{{endpoint="completions",outcome="{o}"}}', 0)
                       for o in ("disconnected",))
    assert disconnected == NUM_HANGUPS + NUM_TIMEOUTS
    # A hung-up 400-token request would hold its blocks for hundreds of steps; all freed means all aborted.
    assert after["trtopt_generation_tokens_total"] - before["trtopt_generation_tokens_total"] < \
        (NUM_CLIENTS - NUM_HANGUPS) * 24 + (NUM_HANGUPS + NUM_TIMEOUTS) * 200
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    ok = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, timeout=60,
                    json={"model": MODEL, "prompt": "still there?", "max_tokens": 4, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
