"""02's two backends, each giving a shard's states batch by batch: the target loaded here
(``TransformersSource``: one forward per token-budget batch, hooks keep only the chosen states), or vLLM servers
in ``extract_hidden_states`` mode (``VllmSource``, through ``vllm_backend.VllmClient``). 03's online source runs
the same two per micro-batch.
"""

from __future__ import annotations

from pathlib import Path

from eagle3nb.data.batching import pack_batches
from eagle3nb.data.head import TargetHead
from eagle3nb.hf import STATES, load_target
from eagle3nb.hidden.capture import capture_batch
from eagle3nb.hidden.params import HiddenParams
from eagle3nb.hidden.prepare import HiddenStatesError
from eagle3nb.hidden.vllm_backend import VllmClient


class TransformersSource:
    """The target loaded here; one forward per token-budget batch, hooks keep only the chosen states."""

    def __init__(self, P: HiddenParams, model_dir: Path, info: dict, layer_ids: list[int]):
        self.model = load_target(model_dir, trust_remote_code=P.trust_remote_code, use=STATES, dtype=P.dtype)
        cfg = self.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        if cfg.num_hidden_layers != info["num_layers"] or cfg.hidden_size != info["hidden_size"]:
            raise HiddenStatesError(f"{model_dir}: loaded model shape differs from its config.json")
        self.layer_ids, self.tokens_per_batch = layer_ids, P.tokens_per_batch

    def batches(self, shard_samples: list[dict]):
        """Yield ``(rows, aux [B, T, n, H], final [B, T, H])`` per batch (rows index ``shard_samples``)."""
        for rows in pack_batches([len(s["input_ids"]) for s in shard_samples], self.tokens_per_batch):
            aux, final = capture_batch(self.model, [shard_samples[r]["input_ids"] for r in rows], self.layer_ids)
            yield rows, aux, final


class VllmSource:
    """vLLM servers (or embedded ones) started with extract_hidden_states; see ``vllm_backend``. ``home``: the
    servers this process keeps busy (03's share under torchrun), the others take only its retries."""

    def __init__(self, P: HiddenParams, info: dict, layer_ids: list[int], head: TargetHead,
                 home: list[str] | None = None):
        self.client = VllmClient(P.urls, P.api_key(), P.vllm_model, num_states=len(layer_ids) + 1,
                                 hidden_size=info["hidden_size"], timeout_s=P.request_timeout_s,
                                 concurrency=P.concurrency, max_retries=P.max_retries, backoff_s=P.retry_backoff_s,
                                 home=home)
        self.head = head
        self.checked = self.mismatched = 0

    def batches(self, shard_samples: list[dict]):
        """Yield ``([row], aux [1, T, n, H], final [1, T, H])`` per sample, in order."""
        items = [(s["id"], s["input_ids"]) for s in shard_samples]
        for r, (hs, next_token) in enumerate(self.client.map(items)):
            final = self.head.norm(hs[:, -1]).to(hs.dtype)
            if next_token is not None:
                self._check_model(final[-1:], next_token, shard_samples[r]["id"])
            yield [r], hs[None, :, :-1], final[None]

    def _check_model(self, last, next_token: int, sample_id: str) -> None:
        """The server's greedy token must be what model_path's head says; a different model fails fast."""
        _, argmax = self.head.draft_logits_and_argmax(last)
        self.checked += 1
        self.mismatched += int(int(argmax[0]) != next_token)
        if self.checked >= 8 and self.mismatched > self.checked // 2:
            raise HiddenStatesError(
                f"the server's next token disagrees with model_path's lm_head on {self.mismatched} of {self.checked} "
                f"samples (last: {sample_id}): the server serves another model than model_path, or other layer ids")
