"""`pagelm bench scenarios`' image scenarios on a synthetic Qwen3.5 with a tower (the tiny chat
shape, its tower written by the bench): real servers in every configuration, none skipped, none
differing, and the same image again restored from the prefix cache."""

import os

from pagelm.bench.inputs import tower_path
from pagelm.bench.scenarios import run_scenarios


def test_image_scenarios_run_and_agree(qwen35_chat_gguf, tmp_path):
    tower = tower_path("qwen3.5-tiny-chat", str(tmp_path))
    assert os.listdir(tmp_path) == ["qwen3.5-tiny-chat-tower.gguf"] and tower_path("smollm2-135m") is None
    report = run_scenarios("qwen3.5-tiny-chat", qwen35_chat_gguf, 1, names=("image", "image-again"), mmproj=tower)
    assert report.differing == 0
    for name, runs in report.results.items():
        assert len(runs) == 4 and all(r.observation.skipped is None for r in runs), name
        assert all(r.observation.output.get("prompt_tokens", 0) > 64 for r in runs), runs[0].observation.output
    again = {r.config.prefix_cache: r.observation.cache["cached_tokens"] for r in report.results["image-again"]}
    assert again[True] > 64 and again[False] == 0
    assert "differing scenarios: 0 of 2 in 1 runs" in report.markdown()
