"""``eagle3nb serve``: the embedded OpenAI-compatible server (imports fast; the model loads in ``serve``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

from eagle3nb.data.head import served_target
from eagle3nb.drafts import PACKAGES, Serving, check_serving, method_of, served_as
from eagle3nb.errors import UserError
from eagle3nb.serve.spec_batcher import SpecEngine
from eagle3nb.toy import resolve_model_path


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a local Hugging Face causal LM (or toy:smoke / toy:demo) "
                                            "over an OpenAI-compatible API, like vLLM with a reasoning parser",
                              description="Serve a model folder (or the shipped toy:smoke / toy:demo) on an "
                                          "OpenAI-compatible API the way vLLM does: /v1/models, /v1/chat/completions "
                                          "with the reasoning split out (or left inline with --no-reasoning-parser), "
                                          "return_token_ids, and speculative decoding with --draft. The tests and "
                                          "vllm_url: embedded use it; no GPU needed.")
    p.add_argument("--model", required=True, help="model folder in Hugging Face layout, or toy:smoke / toy:demo")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the --model value)")
    p.add_argument("--reasoning-field", choices=["reasoning", "reasoning_content", "both"], default="reasoning",
                   help="message field for the think text: new vLLM (reasoning), SGLang / old vLLM "
                        "(reasoning_content), or both")
    p.add_argument("--no-reasoning-parser", action="store_true",
                   help="leave <think>...</think> inline in content, as vLLM does without --reasoning-parser")
    p.add_argument("--api-key-env", default=None, metavar="NAME",
                   help="require 'Authorization: Bearer KEY' with KEY read from environment variable NAME")
    p.add_argument("--max-batch-size", type=int, default=32, help="most requests decoded together")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the model folder run Python code of its own (its auto_map), as vLLM's flag does")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the toy's matrices are tiny, and more threads spin against "
                        "the clients and each other on a shared machine)")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help=f"a draft folder of any method ({', '.join(PACKAGES)}; 03's outputs/<run>/03_train/draft): "
                        "decode speculatively")
    p.add_argument("--method", choices=sorted({served_as(m) for m in PACKAGES}), default=None,
                   help="the method the draft is served as, vLLM's speculative-config method (default: the one its "
                        "config.json declares); another is refused before anything loads")
    p.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="k tokens drafted per step (with --draft; a DSpark draft's is its block size)")
    p.add_argument("--hidden-states-dir", default=None, metavar="DIR",
                   help="answer /v1/completions by writing hidden states here (vLLM extract_hidden_states)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="print each chat request's body as vLLM does (its --enable-log-requests at log level DEBUG): "
                        "the server's log is then a traffic log 05_refresh reads")
    p.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                   help="stop when process PID is gone (a stage's embedded server dies with its stage, kill -9 "
                        "included)")
    p.set_defaults(func=serve)


class ServeError(UserError):
    """An option of ``eagle3nb serve`` that cannot work; checked before the model loads."""


def _require_module(name: str, flag: str) -> None:
    if importlib.util.find_spec(name) is None:
        raise ServeError(f"{flag} is not available yet in this version ({name} is missing); run without {flag}")


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}): another server holds it, or the "
                             f"address is not this machine's; pick another --port or --host") from None


def _exit_with(parent: int) -> None:
    """A daemon thread that ends this process once ``parent`` is gone (its pid no longer our parent's)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def check_options(args: argparse.Namespace) -> tuple[Path, str | None]:
    """Every option checked before anything loads: (the model folder, the API key or None)."""
    if args.max_batch_size < 1:
        raise ServeError("--max-batch-size must be at least 1")
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ServeError(f"--api-key-env {args.api_key_env}: that environment variable is unset or empty; "
                             f"export {args.api_key_env}=<key> before starting the server")
    if args.hidden_states_dir:
        _require_module("eagle3nb.serve.extract", "--hidden-states-dir")
    model_dir = resolve_model_path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ServeError(f"--model {args.model}: {model_dir} has no config.json; pass a Hugging Face model folder "
                         f"(or toy:smoke / toy:demo)")
    if args.draft:
        _require_module("eagle3nb.serve.spec_batcher", "--draft")
        if args.num_speculative_tokens < 1:
            raise ServeError("--num-speculative-tokens must be at least 1")
        config = Path(args.draft) / "config.json"
        if not config.is_file():
            raise ServeError(f"--draft {args.draft}: no config.json there; pass 03_train's draft folder "
                             f"(outputs/<run>/03_train/draft)")
        method = args.method or served_as(method_of(json.loads(config.read_text()), args.draft).name)
        check_serving(args.draft, Serving(method, args.num_speculative_tokens, served_target(model_dir),
                                          method_field="--method", k_field="--num-speculative-tokens",
                                          whole_block=True))  # SpecEngine's decoder drafts the whole block
    _check_port(args.host, args.port)
    return model_dir, api_key


def serve(args: argparse.Namespace) -> int:
    """Check every option before loading anything, then load the model and run uvicorn until stopped."""
    model_dir, api_key = check_options(args)
    if args.exit_with_parent:
        _exit_with(args.exit_with_parent)

    import torch
    import uvicorn

    from eagle3nb.hf import DECODER, load_target, load_tokenizer
    from eagle3nb.serve.app import Server, create_app
    from eagle3nb.serve.batcher import Engine, Metrics

    torch.set_num_threads(max(1, args.threads))
    name = args.served_model_name or args.model
    tokenizer = load_tokenizer(model_dir, trust_remote_code=args.trust_remote_code)
    model = load_target(model_dir, trust_remote_code=args.trust_remote_code, use=DECODER)
    metrics = Metrics(name)
    decoder = None
    if args.draft:
        decoder = SpecEngine(model, tokenizer, Path(args.draft), args.num_speculative_tokens, metrics)
    engine = Engine(model, tokenizer, model_name=name, max_batch_size=args.max_batch_size, decoder=decoder,
                    metrics=metrics)
    hidden_dir = Path(args.hidden_states_dir) if args.hidden_states_dir else None
    if hidden_dir is not None:
        hidden_dir.mkdir(parents=True, exist_ok=True)
    server = Server(engine, model_name=name, model_dir=str(model_dir), reasoning_field=args.reasoning_field,
                    reasoning_parser=not args.no_reasoning_parser, api_key=api_key, hidden_states_dir=hidden_dir,
                    log_requests=args.enable_log_requests)
    print(f"eagle3nb serve: {name} ({model_dir}) on http://{args.host}:{args.port}/v1 "
          f"(reasoning {'-> ' + args.reasoning_field if server.reasoning_parser else 'inline'}, "
          f"auth {'on' if api_key else 'off'}, max batch {args.max_batch_size}"
          f"{', draft ' + args.draft if args.draft else ''})", flush=True)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="info")
    return 0
