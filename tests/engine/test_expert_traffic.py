"""The expert bytes a mixture-of-experts model reads, counted as it runs (models.moe.track): each call
reads its routed experts' bytes once, however many rows took them, and the shared expert's; summed
against the file's own tensor sizes and the routes the layers took."""

import pytest

import pagelm
from pagelm.formats.gguf import GGUFFile
from pagelm.models.moe import mixtures, track


def _expert_bytes(path: str, n_experts: int) -> tuple[dict[int, int], int]:
    """(bytes of one routed expert, per layer; the shared expert's bytes, per layer) from the file."""
    with GGUFFile.open(path) as f:
        infos = f.tensors
        routed, shared = {}, 0
        for name, info in infos.items():
            layer = int(name.split(".")[1]) if name.startswith("blk.") else None
            if "_exps.weight" in name:
                routed[layer] = routed.get(layer, 0) + info.nbytes // n_experts
            elif "_shexp.weight" in name and "gate_inp" not in name:
                shared += info.nbytes
        return routed, shared // max(1, len(routed))


@pytest.mark.parametrize("fixture", ["qwen3moe_tiny_gguf", "qwen_moe_tiny", "gpt_oss_tiny_gguf"])
def test_a_step_reads_its_routed_experts_bytes_once_each(request, fixture):
    path = request.getfixturevalue(fixture)
    model = pagelm.load(path)
    found = mixtures(model.network)
    routed, shared = _expert_bytes(path, len(found[0].gate_up))
    traffic = track(model.network)
    assert traffic.layers == len(found) == len(routed) > 0
    for experts in found:
        experts.routes = []
    sessions = [model.session(32) for _ in range(3)]
    for i, s in enumerate(sessions):
        s.prefill([5 + i, 9, 11 + 7 * i])
    traffic.reset()
    for e in found:
        e.routes.clear()
    model.decode_batch(sessions, [17, 301, 17])  # two sequences alike: experts they share are read once
    want = sum(len(set(e.routes[0].reshape(-1).tolist())) * routed[layer] + shared
               for layer, e in zip(sorted(routed), found))
    assert traffic.bytes == want and traffic.rows == 3 * len(found)
    assert traffic.per_token == pytest.approx(want / 3)
    assert traffic.expert_bytes == sum(routed.values()) * len(found[0].gate_up) + shared * len(found)


def test_the_traffic_reaches_metrics_as_prometheus_lines():
    from pagelm.serve.metrics import prometheus_text

    text = prometheus_text({"experts": {"expert_bytes": 1 << 30, "layers": 40, "decoded_tokens": 12,
                                        "touched_bytes_per_token": 123456}})
    assert "pagelm_experts_touched_bytes_per_token 123456\n" in text and "pagelm_experts_layers 40\n" in text


class _Hints:
    """Records the madvise calls an ExpertPages makes, in place of its file map."""

    def __init__(self):
        self.calls = []

    def madvise(self, advice, start, length):
        self.calls.append((advice, start, length))


@pytest.mark.parametrize("fixture", ["qwen3moe_tiny_gguf", "qwen_moe_tiny", "gpt_oss_tiny_gguf"])
def test_the_routed_experts_pages_are_hinted_before_a_step_reads_them(request, fixture):
    """A prefill's call hints the pages of exactly the experts its rows were routed to (every expert tensor of the
    layer: gate, up and down rows), as the file's own tensor offsets place them; a decode step's hints nothing."""
    import mmap

    import numpy as np

    from pagelm.weights.mapped import page_spans

    path = request.getfixturevalue(fixture)
    model = pagelm.load(path)
    found = mixtures(model.network)
    n = len(found[0].gate_up)
    with GGUFFile.open(path) as f:
        tensors = {name: (info.offset, info.nbytes // n) for name, info in f.tensors.items() if "_exps.weight" in name}
    for e in found:
        e.routes, e.pages._map = [], _Hints()
    session = model.session(32)
    session.prefill([5, 9, 11, 40, 7])
    session.decode(17)
    for layer, e in enumerate(found):
        assert len(e.routes) == 2  # the prefill's call and the decode step's
        names = [name for name in tensors if name.startswith(f"blk.{layer}.")]
        want = []
        for chosen in e.routes[:1]:  # the prefill's
            for expert in sorted(set(chosen.reshape(-1).tolist())):
                for name in sorted(names):
                    offset, per = tensors[name]
                    starts, lengths = page_spans(offset + expert * per, per, np.zeros(1, np.int64))
                    want += [(mmap.MADV_WILLNEED, s, l) for s, l in zip(starts.tolist(), lengths.tolist())]
        assert sorted(e.pages._map.calls) == sorted(want) and len(names) >= 2
