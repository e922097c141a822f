"""A scripted OpenAI-compatible chat server for proving the synth client robust and fast.

It answers at once, after a random latency, or with the faults real servers produce under load: 5xx, 429,
a hang past the client's timeout, a dropped connection, a 200 whose JSON is cut short or has no choice, a 400,
and (not in the default mix, as no retry fixes it) a 401. Faults are
planned per conversation and attempt, deterministically from a seed, so a test knows what to expect.
With ``upstream`` (a real server's address) it injects the same faults in front of that server and passes
every other request through, so a client meets real answers (token ids included) and faults alike.
It speaks raw HTTP/1.1 over asyncio (keep-alive included): a dropped connection is really dropped, and the
server costs little enough to measure a client against it. Runs on a thread (``with FaultServer(...)``) or
as a process (``python -m eagle3nb.synth.faults --port N``); ``GET /stats`` returns each request's
(start, end) times for in-flight measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import threading
import time
from typing import Any

FAULTS = ("500", "503", "429", "timeout", "drop", "malformed", "nochoice", "400")
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 429: "Too Many Requests",
           500: "Internal Server Error",
           503: "Service Unavailable"}


class FaultServer:
    """``fault_rate``: share of conversations that get faults; each such conversation fails on its first
    1..``max_faults`` attempts with faults drawn from ``faults``. ``latency_s``: (low, high) uniform delay.
    ``reasoning_field``: where the reasoning goes (None: nowhere, a server without a reasoning parser).
    ``upstream``: ``http://host:port`` of a server whose answers (and model list) are passed through."""

    def __init__(self, *, fault_rate: float = 0.0, faults: tuple[str, ...] = FAULTS, max_faults: int = 2,
                 latency_s: tuple[float, float] = (0.0, 0.0), hang_s: float = 5.0,
                 reasoning_field: str | None = "reasoning", model: str = "fault-model", seed: int = 0,
                 host: str = "127.0.0.1", port: int = 0, upstream: str | None = None):
        self.upstream = upstream
        self.fault_rate, self.faults, self.max_faults = fault_rate, faults, max_faults
        self.latency_s, self.hang_s = latency_s, hang_s
        self.reasoning_field, self.model, self.seed = reasoning_field, model, seed
        self.host, self.port = host, port
        self.attempts: dict[str, int] = {}
        self.served: list[tuple[str, str]] = []  # (conversation key, fault or "ok") in arrival order
        self.intervals: list[tuple[float, float]] = []
        self.auth: set[str] = set()  # Authorization headers seen
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @staticmethod
    def key(messages: list[dict]) -> str:
        """The conversation's key: faults are planned and attempts counted per key."""
        return hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:12]

    def plan(self, key: str) -> list[str]:
        """The faults this conversation meets, in attempt order (then it succeeds)."""
        rng = random.Random(f"{self.seed}:{key}")
        if rng.random() >= self.fault_rate:
            return []
        return [rng.choice(self.faults) for _ in range(rng.randint(1, self.max_faults))]

    def answer(self, body: dict) -> dict:
        last = body["messages"][-1]["content"]
        thinking = (body.get("chat_template_kwargs") or {}).get("thinking", True)
        message: dict[str, Any] = {"role": "assistant", "content": f"The answer to '{last}' is 4."}
        if thinking and self.reasoning_field:
            message[self.reasoning_field] = f"The user asks '{last}'. Two plus two is four."
        return {
            "id": "chatcmpl-fault", "object": "chat.completion", "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22},
        }

    async def _pass_through(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """The upstream server's (status, JSON answer) to the same request."""
        import httpx

        async with httpx.AsyncClient(base_url=self.upstream, timeout=600.0) as client:
            resp = await client.request(method, path, json=body)
        return resp.status_code, resp.json()

    async def _send(self, writer: asyncio.StreamWriter, code: int, payload: bytes, ctype="application/json") -> None:
        head = (f"HTTP/1.1 {code} {REASONS.get(code, 'Error')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n")
        writer.write(head.encode() + payload)
        await writer.drain()

    async def _chat(self, writer: asyncio.StreamWriter, path: str, body: dict) -> bool:
        """Answer one chat request; False when the connection was dropped."""
        key = self.key(body["messages"])
        attempt = self.attempts.get(key, 0)
        self.attempts[key] = attempt + 1
        plan = self.plan(key)
        fault = plan[attempt] if attempt < len(plan) else "ok"
        self.served.append((key, fault))
        lo, hi = self.latency_s
        if hi > 0:
            await asyncio.sleep(self._rng.uniform(lo, hi))
        if fault == "drop":
            writer.transport.abort()
            return False
        if fault == "timeout":
            await asyncio.sleep(self.hang_s)
        if fault in ("500", "503", "429", "400", "401"):
            err = {"error": {"message": f"injected {fault}", "type": "fault", "code": int(fault)}}
            await self._send(writer, int(fault), json.dumps(err).encode())
        else:
            code, answer = await self._pass_through("POST", path, body) if self.upstream else (200, self.answer(body))
            if code != 200:
                await self._send(writer, code, json.dumps(answer).encode())
            elif fault == "malformed":
                await self._send(writer, 200, json.dumps(answer).encode()[:40])
            elif fault == "nochoice":
                await self._send(writer, 200, json.dumps({**answer, "choices": []}).encode())
            else:
                await self._send(writer, 200, json.dumps(answer).encode())
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                method, target, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                raw = await reader.readexactly(int(headers.get("content-length", 0) or 0))
                path = target.split("?")[0].rstrip("/")
                self.auth.add(headers.get("authorization", ""))
                if method == "POST" and path.endswith("/chat/completions"):
                    t0 = time.time()
                    alive = await self._chat(writer, path, json.loads(raw))
                    self.intervals.append((t0, time.time()))
                    if not alive:
                        return
                elif path.endswith("/models") and self.upstream:
                    code, data = await self._pass_through("GET", path)
                    await self._send(writer, code, json.dumps(data).encode())
                elif path.endswith("/models"):
                    data = {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fault"}]}
                    await self._send(writer, 200, json.dumps(data).encode())
                elif path == "/stats":
                    await self._send(writer, 200, json.dumps({"intervals": self.intervals}).encode())
                elif path == "/health":
                    await self._send(writer, 200, b"{}")
                else:
                    await self._send(writer, 404, b'{"error": {"message": "not found"}}')
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # client went away, or the server is stopping
        finally:
            writer.close()

    async def serve(self) -> None:
        server = await asyncio.start_server(self._handle, self.host, self.port, backlog=4096)
        self.port = server.sockets[0].getsockname()[1]
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        async with server:
            await self._stop.wait()

    def start(self) -> "FaultServer":
        self._thread = threading.Thread(target=lambda: asyncio.run(self.serve()), daemon=True)
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "FaultServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency", type=float, nargs=2, default=(0.0, 0.0), metavar=("LOW", "HIGH"))
    ap.add_argument("--fault-rate", type=float, default=0.0)
    args = ap.parse_args(argv)
    srv = FaultServer(port=args.port, latency_s=tuple(args.latency), fault_rate=args.fault_rate)

    async def run() -> None:
        task = asyncio.create_task(srv.serve())
        await asyncio.get_running_loop().run_in_executor(None, srv._ready.wait)
        print(srv.url, flush=True)
        await task

    asyncio.run(run())


if __name__ == "__main__":
    main()
