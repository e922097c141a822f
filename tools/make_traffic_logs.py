"""Make the traffic log the refresh tests read (tests/fixtures/traffic/): a server's own request log, written while the
real openai client sends it requests.

    python tools/make_traffic_logs.py --server embedded   # eagle3nb serve --enable-log-requests (vLLM's DEBUG lines)
    python tools/make_traffic_logs.py --server vllm --arith 8 --other 8   # the real vLLM, its request log at DEBUG

The requests are toy:heldout prompts, arithmetic-rich (the demo world's weak domain: a draft trained without
arithmetic), plus one request that pastes an API key into its message, which the reader must redact. Each log keeps
the server's whole output (start-up lines included), as a user would hand it over, with this machine's absolute
paths scrubbed outside the request bodies (``scrub``: a committed fixture names no one's folders).

    python tools/make_traffic_logs.py --scrub-only        # scrub the committed logs in place (no server)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.traffic import VLLM_BODY, read_traffic
from eagle3nb.launch import start_server
from eagle3nb.serve.vllm import start_vllm

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "traffic"
FAKE_KEY = "sk-" + "test0000fixture0000key0000"
# An absolute path of a machine: a first folder of the usual roots, then anything a path holds.
MACHINE_PATH = re.compile(r"/(?:work|home|root|tmp|usr|opt|var|Users|mnt|srv|private|scratch|nix)/[\w.+@/-]*")
# (marker inside a path, what the part up to it becomes): the tail after the marker is kept, it says what the file is
PLACES = (("/site-packages/", "<site-packages>/"), ("/lib/python3", "<python>/lib/python3"),
          ("/eagle3nb/", "<eagle3nb>/"))


def _place(path: str) -> str:
    for marker, name in PLACES:
        if marker in path:
            return name + path.split(marker, 1)[1]
    if path.startswith("/tmp/"):
        return "<tmp>/" + path[len("/tmp/"):]
    return "<path>/" + path.rstrip("/").rsplit("/", 1)[-1]


def scrub(text: str) -> str:
    """``text`` with every machine path outside a request body replaced by where it points (``<site-packages>/...``,
    ``<eagle3nb>/...``, ``<tmp>/...``); the bodies are kept byte for byte, since they are what the reader reads."""
    return "".join(line if VLLM_BODY.search(line) else MACHINE_PATH.sub(lambda m: _place(m.group(0)), line)
                   for line in re.findall(r"[^\n]*\n|[^\n]+$", text))


def requests(n_arith: int, n_other: int) -> list[list[dict]]:
    rows = load_prompts("toy:heldout", 227)
    arith = [r["messages"] for r in rows if r["category"] == "arithmetic"][:n_arith]
    other = [r["messages"] for r in rows if r["category"] != "arithmetic"][:n_other]
    mixed = [m for pair in zip(arith, other) for m in pair] + arith[len(other):] + other[len(arith):]
    return mixed + [[{"role": "user", "content": f"My key {FAKE_KEY} fails, what is 2 + 3?"}]]


def main() -> None:
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=["embedded", "vllm"])
    ap.add_argument("--arith", type=int, default=60)
    ap.add_argument("--other", type=int, default=60)
    ap.add_argument("--scrub-only", action="store_true", help="scrub the committed logs in place")
    args = ap.parse_args()
    if args.scrub_only:
        for log in sorted(OUT.glob("*.log")):
            log.write_bytes(scrub(log.read_bytes().decode()).encode())
            print(f"{log}: scrubbed")
        return
    if not args.server:
        ap.error("--server is required (or --scrub-only)")
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
    dest.write_bytes(scrub(Path(handle.log_path).read_bytes().decode()).encode())
    print(f"{dest}: {read_traffic(dest, 1).requests} request bodies in {len(dest.read_text().splitlines())} lines")


if __name__ == "__main__":
    main()
