"""Make the traffic log the refresh tests read (tests/fixtures/traffic/): a server's own request log, written while the
real openai client sends it requests.

    python tools/make_traffic_logs.py --server embedded   # eagle3nb serve --enable-log-requests (vLLM's DEBUG lines)
    python tools/make_traffic_logs.py --server vllm --arith 8 --other 8   # the real vLLM, its request log at DEBUG

The requests are toy:heldout prompts, arithmetic-rich (the demo world's weak domain: a draft trained without
arithmetic), plus one request that pastes an API key into its message, which the reader must redact. Each log keeps
the server's whole output (start-up lines included), as a user would hand it over.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.traffic import read_traffic
from eagle3nb.launch import start_server
from eagle3nb.serve.vllm import start_vllm

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "traffic"
FAKE_KEY = "sk-" + "test0000fixture0000key0000"


def requests(n_arith: int, n_other: int) -> list[list[dict]]:
    rows = load_prompts("toy:heldout", 227)
    arith = [r["messages"] for r in rows if r["category"] == "arithmetic"][:n_arith]
    other = [r["messages"] for r in rows if r["category"] != "arithmetic"][:n_other]
    mixed = [m for pair in zip(arith, other) for m in pair] + arith[len(other):] + other[len(arith):]
    return mixed + [[{"role": "user", "content": f"My key {FAKE_KEY} fails, what is 2 + 3?"}]]


def main() -> None:
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=["embedded", "vllm"], required=True)
    ap.add_argument("--arith", type=int, default=60)
    ap.add_argument("--other", type=int, default=60)
    args = ap.parse_args()
    handle = (start_server("toy:smoke", extra_args=["--enable-log-requests"]) if args.server == "embedded" else
              start_vllm("toy:smoke", log_requests=True))
    try:
        client = OpenAI(base_url=handle.base_url, api_key="EMPTY")
        for messages in requests(args.arith, args.other):
            client.chat.completions.create(model="toy:smoke", messages=messages, max_completion_tokens=4,
                                           temperature=0.0)
    finally:
        handle.stop()
    OUT.mkdir(parents=True, exist_ok=True)
    dest = OUT / f"{args.server}-requests.log"
    shutil.copy(handle.log_path, dest)
    print(f"{dest}: {read_traffic(dest, 1).requests} request bodies in {len(dest.read_text().splitlines())} lines")


if __name__ == "__main__":
    main()
