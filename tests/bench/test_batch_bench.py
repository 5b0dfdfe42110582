"""`pagelm bench batch` end to end on a small model: the contract lines other checks read, the
check of every batched sequence against decoding alone, and the memory line."""

import re

from pagelm import cli


def test_bench_batch_prints_its_contract_lines(qwen35_chat_gguf, capsys, tmp_path):
    chart = tmp_path / "batch.png"
    code = cli.main(["bench", "batch", qwen35_chat_gguf, "--sizes", "1,3", "--tokens", "2", "--runs", "1",
                     "--threads", "1", "--png", str(chart)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^batch 1: 1\.00× batch 1$", out, re.M)
    assert re.search(r"^batch 3: \d+\.\d\d× batch 1$", out, re.M)
    assert re.search(r"^differing sequences: 0 of 4$", out, re.M)  # 1 + 3 sequences, each checked alone
    added, state = map(float, re.search(
        r"^anonymous memory per added sequence: ([\d.]+) MiB \(its state: ([\d.]+) MiB, context 4096\)$",
        out, re.M).groups())
    assert state > 0 and added == added  # a figure, whatever this process allocated meanwhile
    assert re.search(r"^float32 FMA peak of these threads: \d+ GFLOP/s ", out, re.M)
    assert re.search(r"^\| 3 \|( [^|]+ \|){4} \d+ \(\d+%\) \|", out, re.M)  # the matmuls' GFLOP/s, share of peak
    assert chart.stat().st_size > 0


def test_bench_batch_splits_llamas_compiled_layers(smollm2_gguf, capsys):
    """SmolLM2's one-token layers run as compiled calls (models.token_layers): the split still finds
    their products' time and flops."""
    code = cli.main(["bench", "batch", smollm2_gguf, "--sizes", "1,2", "--tokens", "2", "--runs", "1",
                     "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    for n in (1, 2):
        matmuls, head = map(float, re.search(rf"^\| {n} \|(?: [^|]+ \|){{3}} ([\d.]+) \+ ([\d.]+) \+ [-\d.]+ \| (\d+) ",
                                             out, re.M).groups()[:2])
        assert matmuls > 0 and head > 0
    assert re.search(r"^differing sequences: 0 of 3$", out, re.M)
