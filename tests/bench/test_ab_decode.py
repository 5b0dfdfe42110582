"""bench/ab_decode.py end to end on a tiny model: one worker per source tree, every tree timed."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ab_decode_times_each_tree(qwen35_chat_gguf):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab_decode.py"), qwen35_chat_gguf, ROOT, ROOT,
                          "--sequences", "2", "--rounds", "2", "--steps", "2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = re.findall(rf"^\| {re.escape(ROOT)} \| (\d+\.\d\d) \| (\d+\.\d\d) \|$", run.stdout, re.M)
    assert len(rows) == 2, run.stdout  # the same tree twice: two workers, two rows (the host's noise)
    assert all(float(median) >= float(low) > 0 for median, low in rows)
    assert "2 sequence(s), 2 rounds of 2 steps, weights mapped" in run.stdout
