"""The embedded servers on the GPU: ``hf.load_target(use=DECODER)`` moves the target to cuda, and the speculative
engine runs the draft on the target's device and dtype."""

from __future__ import annotations

import pytest
from gpu_world import MAX_NEW, MAX_TOKENS, N_SAMPLES, K, fmt, needs_cuda, reads_differently, versus_local

pytestmark = needs_cuda()


@pytest.mark.covers("eagle3nb/serve/batcher.py", "eagle3nb/hf.py",
                    fix="see eagle3nb/serve/batcher.py and eagle3nb/hf.py load_target")
def test_embedded_server(work, toy, reference, record_property):
    """01 ``synth.run`` against the embedded server on cuda, greedy, gives the CPU target's greedy token ids (>= 90%
    of samples identical: GPU kernels may break near-ties) and server ids == template ids on every sample."""
    from eagle3nb.data.samples import load_samples
    from eagle3nb.launch import start_server
    from eagle3nb.params import from_dict
    from eagle3nb.synth.stage import run

    expected = {r["id"]: r["input_ids"] for r in load_samples(reference["synth"], statuses=None)}
    out = work / "01-served"
    with start_server(toy) as server:
        run(from_dict("01_synth", {"model_path": str(toy), "vllm_url": server.url, "prompts": "toy:train",
                                   "max_samples": N_SAMPLES, "max_completion_tokens": MAX_NEW, "temperature": 0.0,
                                   "output_dir": str(out), "run_name": "gpu-check"}))
    rows = load_samples(out, statuses=None)
    matched = sum(r["ids_match"] is True for r in rows)
    same = sum(r["input_ids"] == expected.get(r["id"]) for r in rows)
    measured = (f"{len(rows)} greedy samples from the server on cuda: {same} equal the CPU target's greedy ids "
                f"(>= 90%), server ids == template ids on {matched}")
    record_property("measured", measured)
    fix = ("the embedded server on GPU decodes differently: check BatchDecoder in eagle3nb/serve/batcher.py, "
           "load_target in eagle3nb/hf.py")
    assert matched == len(rows) == N_SAMPLES, f"{measured}  -> {fix}"
    assert same >= 0.9 * len(rows), f"{measured}  -> {fix}"


@pytest.mark.covers("eagle3nb/serve/spec_batcher.py", "eagle3nb/decoder/batch.py",
                    fix="see eagle3nb/serve/spec_batcher.py and eagle3nb/decoder/batch.py")
def test_embedded_spec_server(toy, draft_dir, prompts, local_cpu, record_property):
    """``serve.spec_batcher`` (draft on the target's device and dtype): 04's ``bench_endpoint`` greedy and at
    temperature 0.8 without errors, acceptance length within 15% of CPU local decoding."""
    from eagle3nb.accept.online import bench_endpoint
    from eagle3nb.launch import start_server

    rows, _, _ = prompts
    with start_server(toy, draft_dir=draft_dir, num_speculative_tokens=K) as server:
        greedy = bench_endpoint("embedded-eagle3", server.base_url, rows, [4], MAX_TOKENS, 0.0, warmup=0)[0]
        sampled = bench_endpoint("embedded-eagle3", server.base_url, rows[:4], [4], MAX_TOKENS, 0.8, warmup=0)[0]
    for r, how in ((greedy, "greedy"), (sampled, "temperature 0.8")):
        assert r["errors"] == 0, (f"{r['errors']} of {r['requests']} {how} requests failed: {r.get('first_error')}  "
                                  "-> the speculative engine fails on GPU: see the server log named in gpu_check.log "
                                  "(eagle3nb/serve/spec_batcher.py, eagle3nb/decoder/)")
    tau, local = greedy["acceptance_length"] or 0.0, local_cpu(draft_dir)["acceptance_length"]
    measured = f"{versus_local(tau, local, 0.15)}; sampled acceptance length {fmt(sampled['acceptance_length'])}"
    record_property("measured", measured)
    assert tau > 1.0 and abs(tau - local) <= 0.15 * local, \
        f"{measured}  -> {reads_differently('the embedded speculative server')}"
