"""The tolerant ShareGPT reader on a small file cut off mid-element, like the packaged one."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np

from dlora.bench import sharegpt
from dlora.bench.workload import WorkloadSpec, generate_workload


def _conv(i, human_first=True, turns=2, words=20):
    roles = ["human", "gpt"] if human_first else ["gpt", "human"]
    return {
        "id": f"c{i}",
        "conversations": [{"from": roles[t % 2], "value": " ".join(["word"] * words)} for t in range(turns)],
    }


def test_iter_json_array_stops_at_truncation():
    text = json.dumps([_conv(i) for i in range(5)], indent=2)
    cut = text[: text.index('"c4"') + 10]  # inside the fifth element
    f = io.StringIO(cut)
    items = list(sharegpt.iter_json_array(sharegpt._open_array(f)))
    assert [x["id"] for x in items] == ["c0", "c1", "c2", "c3"]


def test_iter_json_array_across_chunks(monkeypatch):
    monkeypatch.setattr(sharegpt, "_CHUNK", 7)  # elements straddle many reads
    text = json.dumps([_conv(i) for i in range(6)])
    items = list(sharegpt.iter_json_array(sharegpt._open_array(io.StringIO(text))))
    assert len(items) == 6


def test_load_samples_selects_and_filters(tmp_path):
    convs = [
        _conv(0),  # kept
        _conv(1, human_first=False),  # first turn not human: dropped
        _conv(2, turns=1),  # single turn: dropped
        _conv(3, words=2),  # prompt < 4 tokens: dropped by the length filter
        _conv(4, words=1500),  # prompt > 1024 tokens: dropped
        _conv(5, words=40),  # kept
    ]
    text = json.dumps(convs)
    path = tmp_path / "sharegpt.json"
    path.write_text(text + "\n" + text[:50])  # trailing junk after the array is ignored
    samples = sharegpt.load_samples(path)
    assert [s.prompt_len for s in samples] == [round(20 / 0.86), round(40 / 0.86)]
    assert samples[0].prompt.startswith("word word")


def test_sample_is_seeded_and_cycles(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([_conv(i, words=10 + i) for i in range(5)]))
    a = sharegpt.sample(12, np.random.default_rng(4), path)
    b = sharegpt.sample(12, np.random.default_rng(4), path)
    assert a == b and len(a) == 12
    assert len({s.prompt_len for s in a}) == 5  # every conversation used, then repeated


def test_sharegpt_workload_uses_real_prompts(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([_conv(i, words=10 + i) for i in range(5)]))
    spec = WorkloadSpec(num_prompts=8, dataset="sharegpt", dataset_path=str(path), output_len=7)
    reqs = generate_workload(spec)
    assert all(r.prompt.startswith("word") and r.output_len == 7 for r in reqs)
    scaled = generate_workload(dataclasses.replace(spec, length_scale=2.0))
    assert all(not r.prompt.startswith("word") for r in scaled)  # rescaled lengths get synthetic text
    assert [r.prompt_len for r in scaled] == [2 * r.prompt_len for r in reqs]
