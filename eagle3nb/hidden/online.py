"""02's work done on demand: the hidden states of 01's samples computed by the target when 03 asks for them.

``OnlineStates(HP)`` offers what 03 reads from :class:`~eagle3nb.data.reader.HiddenStates` (``len``, ``[i]``,
``.meta``, ``.d2t``, ``.t2d``, ``.embed_tokens()``, ``.lm_head()``, ``.target_probs``, ``.target_argmax``), built
with 02's own pieces: its sample preparation (so the samples, their order and their ids are 02's index), its
layer ids, draft vocabulary and target head, and its two backends (the target loaded here, or a vLLM server in
``extract_hidden_states`` mode through :class:`~eagle3nb.hidden.vllm_backend.VllmClient`). ``items(indices)``
runs the target once over a whole micro-batch. The draft vocabulary and the target's head are written where 02
would write them, so 04 and a later 02 find them.

With ``cache_dir`` (03's ``hybrid`` source) the target runs over each sample alone, every computed sample is
stored in 02's ``storage`` as it goes and every item, the first time included, is what that storage gives back
(encode -> decode), so training on the cache in later epochs is training on the same numbers. The cache is 02's
shard format (``write_shard``, atomic) listed with each shard's size and sha256; on opening, a shard that fails
``check_shard`` or is missing from the lists (killed between the file and the list) is deleted and its samples
are computed again.

Several processes (03 under torchrun, ``share=(rank, world)``) share one cache without locks, which network file
systems break: each shard is created once, by a hard link from its writer's temporary file to a name no other
shard has (a taken name fails the link, so the writer takes the next), and each process lists its own shards in
its own file (``cache.json`` for process 0, ``cache-rank<r>.json`` for the others), rewritten by atomic rename.
A process that misses a sample reads the other lists again before computing it. On opening, process 0 alone
checks and merges every list into ``cache.json`` while the others wait (``barrier``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from eagle3nb.data.head import TargetHead, read_head_tensors, target_info
from eagle3nb.data.reader import FIELDS, HEAD_FILE, HiddenStates
from eagle3nb.data.shards import ShardError, check_shard, decode, encode, shard_name, write_shard
from eagle3nb.data.vocab import VOCAB_FILE, build_draft_vocab, draft_target_ids, load_draft_vocab, save_draft_vocab
from eagle3nb.hf import compute_device
from eagle3nb.hidden.extract import write_head
from eagle3nb.hidden.params import HiddenParams
from eagle3nb.hidden.prepare import HiddenStatesError, aux_layer_ids, data_key, prepare_samples
from eagle3nb.hidden.sources import TransformersSource, VllmSource
from eagle3nb.hidden.vllm_backend import assigned_urls
from eagle3nb.layers import to_sglang
from eagle3nb.progress import write_json_atomic
from eagle3nb.toy import resolve_model_path

if TYPE_CHECKING:
    import torch

CACHE_FILE = "cache.json"
FORMAT = "eagle3nb-online-v1"


def listing_name(rank: int) -> str:
    """The file that lists process ``rank``'s shards of the hybrid cache."""
    return CACHE_FILE if rank == 0 else f"cache-rank{rank}.json"


class OnlineStates(HiddenStates):
    """01's samples as 02 would store them, computed by the target on demand (see the module docstring).

    ``max_length`` cuts what the target runs over (03 never reads further); ``cache_dir`` + ``cache_key`` turn on
    the hybrid cache (a cache made under another key is discarded); ``verify_sha256`` re-hashes cached shards
    when opening; ``write_files`` writes the draft vocabulary and head into 02's folder (one process of several);
    ``share`` = (rank, world) of 03's processes: this one keeps its share of the servers busy and lists its own
    cache shards; ``barrier`` waits for every process (torch.distributed's, under torchrun)."""

    def __init__(self, HP: HiddenParams, *, max_length: int | None = None, cache_dir: Path | None = None,
                 cache_key: dict | None = None, verify_sha256: bool = True, write_files: bool = True,
                 share: tuple[int, int] = (0, 1), barrier: Callable[[], None] | None = None):
        import torch

        self.HP = HP
        self.dir = HP.stage_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model_dir = resolve_model_path(HP.model_path)
        info = target_info(self.model_dir)
        self.info = info
        L = info["num_layers"]
        self.layer_ids = aux_layer_ids(HP, L)
        samples, sample_report = prepare_samples(HP)
        self.max_length = max_length
        self._prepared = samples
        vocab = build_draft_vocab(samples, info["vocab_size"], HP.draft_vocab_size)
        self.d2t, self.t2d = vocab["d2t"], vocab["t2d"]
        vocab_path = self.dir / VOCAB_FILE
        self._head = read_head_tensors(self.model_dir)
        if write_files:  # one writer (03's rank 0): the others compute the same vocabulary and head themselves
            if vocab_path.exists():
                d2t, _ = load_draft_vocab(vocab_path)
                if not torch.equal(d2t, self.d2t):
                    raise HiddenStatesError(
                        f"{vocab_path} holds another draft vocabulary than 02's parameters give for 01's samples "
                        "(02 ran with other settings): point data_dir at another folder, or re-run 02 with these "
                        "parameters")
            else:
                tmp = vocab_path.with_name(f".{vocab_path.name}.tmp")
                save_draft_vocab(tmp, vocab)
                os.replace(tmp, vocab_path)
            if not (self.dir / HEAD_FILE).exists():
                write_head(self.dir / HEAD_FILE, self._head)
        self._rows = None
        self._open = {}
        self.storage = HP.storage if cache_dir is not None else "online"
        self.samples = [{"id": s["id"], "length": len(s["input_ids"]), "category": s["category"]} for s in samples]
        self.meta = {
            "format": FORMAT, "storage": self.storage, "layer_ids": self.layer_ids,
            "sglang_layer_ids": to_sglang(self.layer_ids), "num_layers": L, "hidden_size": info["hidden_size"],
            "vocab_size": info["vocab_size"], "rms_norm_eps": info["rms_norm_eps"],
            "draft_vocab_size": HP.draft_vocab_size, "topk": HP.topk if self.storage == "topk" else None,
            "model_path": str(self.model_dir), "model_fingerprint": info["fingerprint"], "backend": HP.backend,
            "coverage": vocab["coverage"], "samples": self.samples, **sample_report,
        }
        self.target_tokens, self.target_s = 0, 0.0
        self._source = None
        self._target_head: TargetHead | None = None
        self.rank, self.world = share
        self.cache_dir = cache_dir
        self.cache: dict[str, tuple[str, int]] = {}
        self.cache_shards: list[dict] = []  # every shard this process knows of, its own and the others'
        self._own: list[dict] = []  # the shards its own list holds
        self._seen: dict[str, tuple[int, int]] = {}  # another process's list -> (mtime_ns, size) when last read
        self.redone: list[str] = []
        if cache_dir is not None:
            key = dict(cache_key or {}, hidden=data_key(HP, info, self.layer_ids, samples), max_length=max_length)
            if self.rank == 0:
                self._open_cache(key, verify_sha256)
            if barrier is not None:
                barrier()  # process 0 has checked and merged the cache: the others read it now
            if self.rank != 0:
                self._cache_key = key
                self._read_others()

    # ---------------------------------------------------------------- the target

    def head(self) -> TargetHead:
        """The target's norm and head with the draft rows (the vllm backend's norm, topk storage's targets)."""
        if self._target_head is None:
            h = self._head
            self._target_head = TargetHead(h["lm_head.weight"], draft_target_ids(self.d2t), h["norm.weight"],
                                           self.info["rms_norm_eps"], device=compute_device())
        return self._target_head

    def source(self):
        """02's backend, started on first use: the target loaded here, or the vLLM server's client."""
        if self._source is None:
            HP = self.HP
            self._source = (VllmSource(HP, self.info, self.layer_ids, self.head(),
                                       home=assigned_urls(HP.urls, self.rank, self.world)) if HP.backend == "vllm"
                            else TransformersSource(HP, self.model_dir, self.info, self.layer_ids))
        return self._source

    def _sample(self, i: int) -> dict:
        s = self._prepared[i]
        n = len(s["input_ids"]) if self.max_length is None else min(len(s["input_ids"]), self.max_length)
        return {"id": s["id"], "input_ids": s["input_ids"][:n], "loss_mask": s["loss_mask"][:n],
                "category": s["category"]}

    def _compute(self, indices: list[int]) -> list[tuple[dict, "torch.Tensor", "torch.Tensor"]]:
        """(sample, aux [T, n, H], final [T, H]) per index: the target over these samples as one job."""
        todo = [self._sample(i) for i in indices]
        out: list = [None] * len(todo)
        # the hybrid cache runs the target over each sample alone: a cached sample's numbers then depend on the
        # sample only, so one computed again (a damaged shard redone) is bit for bit the one first trained on
        jobs = [[r] for r in range(len(todo))] if self.cache_dir is not None else [list(range(len(todo)))]
        t0 = time.perf_counter()
        for job in jobs:
            for rows, aux, final in self.source().batches([todo[r] for r in job]):
                for b, r in enumerate(rows):
                    n = len(todo[job[r]]["input_ids"])
                    out[job[r]] = (todo[job[r]], aux[b, :n].cpu(), final[b, :n].cpu())
        self.target_s += time.perf_counter() - t0
        self.target_tokens += sum(len(s["input_ids"]) for s in todo)
        return out

    # ---------------------------------------------------------------- what 03 reads

    def __getitem__(self, i: int) -> dict:
        return self.items([i])[0]

    def items(self, indices: list[int]) -> list[dict]:
        """The samples ``indices`` as ``HiddenStates[i]`` gives them; the ones not cached are computed together."""
        missing = [i for i in dict.fromkeys(indices) if self.samples[i]["id"] not in self.cache]
        if missing and self.cache_dir is not None and self.world > 1:
            self._read_others()  # another process may have computed them in an earlier step
            missing = [i for i in missing if self.samples[i]["id"] not in self.cache]
        got: dict[int, dict] = {}
        if missing:
            computed = self._compute(missing)
            if self.cache_dir is None:
                for i, (s, aux, final) in zip(missing, computed):
                    got[i] = self._item(s, {"aux": aux.flatten(-2).float(), "final": final.float()})
            else:
                got.update(self._store(missing, computed))
        return [got[i] if i in got else self._cached(i) for i in indices]

    @staticmethod
    def _item(s: dict, states: dict) -> dict:
        import torch

        return {"id": s["id"], "input_ids": torch.tensor(s["input_ids"], dtype=torch.int64),
                "loss_mask": torch.tensor(s["loss_mask"], dtype=torch.int64), "category": s["category"], **states}

    def verify(self) -> None:
        """Re-hash every cached shard against cache.json."""
        for sh in self.cache_shards:
            check_shard(self.cache_dir / sh["file"], sh["bytes"], sh["sha256"])

    def measure(self, max_tokens: int = 4096) -> dict:
        """The target's extraction throughput on the first samples (about ``max_tokens`` of them), for the cost
        estimate before a run when 02 never ran."""
        picked, n = [], 0
        for i in range(len(self.samples)):
            if n >= max_tokens and picked:
                break
            picked.append(i)
            n += len(self._sample(i)["input_ids"])
        self._compute(picked[:1])  # the first call loads the target / opens the connection
        tokens, seconds = self.target_tokens, self.target_s
        self._compute(picked)
        t, s = self.target_tokens - tokens, self.target_s - seconds
        return {"tokens": t, "seconds": s, "tokens_per_s": t / s if s > 0 else None}

    # ---------------------------------------------------------------- the hybrid cache

    def _open_cache(self, key: dict, verify_sha256: bool) -> None:
        """Process 0, before the others read it: every list merged into ``cache.json`` (all discarded when made
        under another key), each listed shard checked, and shards no list names deleted."""
        d = self.cache_dir
        d.mkdir(parents=True, exist_ok=True)
        for tmp in [*d.glob(".shard-*"), *d.glob(".cache*.tmp*")]:
            tmp.unlink()
        lists = [json.loads(f.read_text()) for f in sorted(d.glob("cache*.json"))]
        want = json.loads(json.dumps(key))
        if any(old.get("key") != want for old in lists):
            print(f"hybrid cache {d}: made with other settings, discarded", flush=True)
            lists = []
        for sh in (sh for old in lists for sh in old["shards"]):
            try:
                check_shard(d / sh["file"], sh["bytes"], sh["sha256"] if verify_sha256 else None)
            except ShardError as e:
                print(f"hybrid cache: redoing {sh['file']} ({e})", flush=True)
                self.redone.append(sh["file"])
                continue
            self._own.append(sh)
        listed = {sh["file"] for sh in self._own}
        for f in d.glob("shard-*.safetensors"):
            if f.name not in listed:  # damaged, or written by a run killed before it listed the file
                if f.name not in self.redone:
                    self.redone.append(f.name)
                f.unlink()
        for f in d.glob("cache-rank*.json"):
            f.unlink()  # their shards are in cache.json now
        for sh in self._own:
            self._know(sh)
        self._cache_key = key
        self._save_cache()

    def _know(self, sh: dict) -> None:
        self.cache_shards.append(sh)
        for j, sid in enumerate(sh["samples"]):
            self.cache[sid] = (sh["file"], j)

    def _read_others(self) -> None:
        """The shards the other processes listed since this one last looked (a list is read again only when its
        size or mtime changed)."""
        known = {sh["file"] for sh in self.cache_shards}
        for f in [self.cache_dir / CACHE_FILE, *sorted(self.cache_dir.glob("cache-rank*.json"))]:
            if f.name == listing_name(self.rank):
                continue
            try:
                st = f.stat()
                if self._seen.get(f.name) == (st.st_mtime_ns, st.st_size):
                    continue
                listed = json.loads(f.read_text())
            except FileNotFoundError:
                continue
            self._seen[f.name] = (st.st_mtime_ns, st.st_size)
            for sh in listed["shards"]:
                if sh["file"] not in known:
                    known.add(sh["file"])
                    self._know(sh)

    def _save_cache(self) -> None:
        write_json_atomic(self.cache_dir / listing_name(self.rank),
                          {"format": FORMAT, "storage": self.storage, "key": self._cache_key,
                           "shards": self._own})

    def _claim(self, part: Path) -> str:
        """Give the finished file ``part`` a shard name no other shard has, by a hard link (atomic, and it fails
        where the name exists, on network file systems too): this process's names first (rank, rank + world,
        ...), the next one when another writer took it."""
        used = {sh["file"] for sh in self.cache_shards}
        n = self.rank
        while True:
            name = shard_name(n)
            n += self.world
            if name in used:
                continue
            try:
                os.link(part, self.cache_dir / name)
            except FileExistsError:
                continue
            part.unlink()
            return name

    def _store(self, indices: list[int], computed: list) -> dict[int, dict]:
        """Encode the computed samples in the storage, write them as one shard, and return what it gives back."""
        import torch

        tensors, items = {}, {}
        for j, (i, (s, aux, final)) in enumerate(zip(indices, computed)):
            enc = {k: v.cpu() for k, v in encode(aux, final, self.storage, self.head(), self.HP.topk).items()}
            tensors[f"{j}.input_ids"] = torch.tensor(s["input_ids"], dtype=torch.int32)
            tensors[f"{j}.loss_mask"] = torch.tensor(s["loss_mask"], dtype=torch.uint8)
            tensors.update({f"{j}.{k}": v.contiguous() for k, v in enc.items()})
            items[i] = self._item(s, decode(enc, self.storage))
        part = self.cache_dir / f".shard-part-r{self.rank}.safetensors"
        written = write_shard(part, tensors)
        sh = {**written, "file": self._claim(part), "samples": [self.samples[i]["id"] for i in indices],
              "num_tokens": sum(len(c[0]["input_ids"]) for c in computed)}
        self._own.append(sh)
        self._know(sh)
        self._save_cache()
        return items

    def _cached(self, i: int) -> dict:
        from safetensors import safe_open

        name, j = self.cache[self.samples[i]["id"]]
        if name not in self._open:
            self._open[name] = safe_open(str(self.cache_dir / name), "pt")
        f = self._open[name]
        try:
            raw = {k: f.get_tensor(f"{j}.{k}") for k in FIELDS[self.storage]}
        except Exception as e:  # a file damaged since it was checked
            raise ShardError(f"{self.cache_dir / name}: cannot read sample {self.samples[i]['id']} ({e}); delete "
                             "the file and resume (its samples are computed again)") from None
        s = self._sample(i)
        return self._item(s, decode(raw, self.storage))

    def cache_bytes(self) -> int:
        """Bytes of every shard in the cache, the other processes' included."""
        if self.world > 1:
            self._read_others()
        return sum(sh["bytes"] for sh in self.cache_shards)
