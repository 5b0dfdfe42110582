"""Small measuring helpers of `pagelm bench`, checked on this process (no server, no model)."""

import mmap
import os

from pagelm.bench.pressure import HintSwitchEmbedding
from pagelm.bench.shared import model_file_pages


def test_model_file_pages_counts_only_the_named_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(4 * mmap.PAGESIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))  # touch every page
        rss, pss = model_file_pages(os.getpid(), str(path))
        assert rss == 4 * mmap.PAGESIZE and 0 < pss <= rss
    assert model_file_pages(os.getpid(), str(tmp_path / "not-mapped.bin")) == (0, 0)


class RecordingEmbedding:
    rows, vocab_size = "bf16", 10

    def __init__(self):
        self.prefetched = []

    def prefetch(self, ids):
        self.prefetched.append(list(ids))

    def lookup(self, ids):
        return list(ids)


def test_hint_switch_skips_only_the_prefetch():
    inner = RecordingEmbedding()
    embedding = HintSwitchEmbedding(inner)
    embedding.prefetch([1, 2])
    embedding.hint = False
    embedding.prefetch([3])
    assert inner.prefetched == [[1, 2]]
    assert embedding.lookup([4]) == [4] and embedding.rows == "bf16" and embedding.vocab_size == 10


def test_pressure_switches_a_mixtures_expert_hints_with_the_embeddings(qwen3moe_tiny_gguf):
    import pagelm
    from pagelm.bench.pressure import run_pressure
    from pagelm.models import moe

    report = run_pressure("qwen3moe-tiny", qwen3moe_tiny_gguf, 1, 16)
    n_mixtures = len(moe.mixtures(pagelm.load(qwen3moe_tiny_gguf).network))
    assert report.expert_hints == n_mixtures > 0
    assert f"the hint switches the routed experts' too, in all {n_mixtures} mixtures of experts" in report.markdown()
    assert all(len(times) == 1 and times[0] > 0 for times in report.ttft.values())
