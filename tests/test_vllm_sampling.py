"""Lossless sampling, held on every engine that verifies drafts by rejection sampling: here our decoder
(``eagle3nb.decoder``) and the fix for the real vLLM's CPU build; the embedded speculative server in
tests/test_bench_server.py, the real vLLM in tests/test_vllm.py and on the MLA + MoE target in
tests/test_family_kimi.py (beside the servers they already run).

The distribution test (helpers in tests/sampling.py): a prompt whose next token is near-certain and the one after
it spread out (the first ``toy:heldout`` position where the target gives its greedy token p > 0.99 and the next
top token p < 0.5: digits, on the smoke toy). The first token a speculative engine emits is the target's own
sample from the prefill, so the test reads the *second* generated token: the first one a draft proposed and
verification accepted or replaced. Its frequencies over ``N`` seeded requests must agree (G-test, false-alarm
rate ``ALPHA`` each) with the target's own probability of it (transformers, marginal over the first token) and,
for vLLM, with a plain server's.

vLLM's CPU build loses the temperature in rejection sampling (docs/upstream/vllm-cpu-expand-loses-temperature.md);
``eagle3nb/serve/vllm_ext/eagle3nb_vllm_fixes/sampling.py`` is the fix, and its replacement kernel is checked here.
"""

from __future__ import annotations

import sys

import pytest
import torch

from sampling import ALPHA, N, decoded_second_tokens, fits_target, spread_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # 300 small decodes: one thread is ~10x faster on shared cores

K = 3


# -- the plugin's replacement kernel ---------------------------------------------------------------------------------

def test_the_plugins_expand_keeps_each_requests_value_in_its_dtype(monkeypatch):
    """``expand`` (what the plugin registers for vLLM's ``expand_kernel`` when the stock CPU one is broken) against
    the kernel's contract, on the dtypes vLLM expands: float temperature and top-p (0.7 stays 0.7, the stock CPU
    fallback's int64 copy would make it 0 or leave garbage), int32 top-k; ``replace_from`` becomes ``replace_to``;
    a request with no draft token takes no slot. Runs here without vLLM (the module needs only torch). <1 s."""
    import importlib.machinery
    import importlib.util

    from eagle3nb.serve.vllm import VLLM_EXT

    # the plugin's package found in the folder vLLM's PYTHONPATH gets, as vLLM imports it, without changing ours
    spec = importlib.machinery.PathFinder.find_spec("eagle3nb_vllm_fixes", [str(VLLM_EXT)])
    plugin = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, plugin)
    spec.loader.exec_module(plugin)
    expand = importlib.import_module("eagle3nb_vllm_fixes.sampling").expand

    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([2, 0, 3, 1])  # draft tokens per request
    cu = counts.cumsum(0).to(torch.int32)
    for values, replace_from, replace_to in ((torch.rand(4, generator=gen) + 0.1, -1.0, 1.0),
                                             (torch.tensor([0.7, -1.0, 1.3, -1.0]), -1.0, 1.0),
                                             (torch.tensor([5, 0, 9, 0], dtype=torch.int32), 0, 7)):
        out = torch.full((int(cu[-1]) + 2,), -7, dtype=values.dtype)  # a larger buffer: the tail is not touched
        expand(out, values, cu, replace_from, replace_to)
        want = [replace_to if v == replace_from else v for v, c in zip(values.tolist(), counts.tolist())
                for _ in range(c)]
        assert out.tolist() == pytest.approx(want + [-7, -7]), (values, out)
        assert out.dtype == values.dtype


# -- our decoder ------------------------------------------------------------------------------------------------------

def test_our_decoder_samples_the_targets_distribution(trained, toy_smoke):
    """Our decoder at T=1 (k=3): the second token's frequencies over N seeds fit the target's probabilities. ~35 s
    (the spread prompt's search, 15 s, included)."""
    spread = spread_prompt(toy_smoke)
    tokens = decoded_second_tokens(toy_smoke, trained["out"] / "03_train" / "draft", spread.ids, K, range(N))
    assert fits_target(tokens, spread) > ALPHA, torch.bincount(torch.tensor(tokens)).nonzero().flatten()
