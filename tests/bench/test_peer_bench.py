"""`pagelm bench peer` end to end on a small model: each runtime's turn in a fresh process, the
table and ratio lines, and pagelm's child decoding exactly what pagelm decodes in process."""

import re

import numpy as np

import pagelm
from pagelm import cli
from pagelm.bench.peer import prompt_tokens, run_peer


def test_bench_peer_prints_a_row_per_runtime(smollm2_gguf, capsys):
    code = cli.main(["bench", "peer", smollm2_gguf, "--prompt-tokens", "20", "--tokens", "4", "--ctx", "64",
                     "--runs", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^\| pagelm \| \d+ \| [\d.]+ \| \d+ \| \d+ \|$", out, re.M), out
    # llama.cpp's row and the ratios where llama-cpp-python runs here, else its error, never neither
    compared = re.search(r"^\| llama\.cpp \| \d+ \| [\d.]+ \| \d+ \| \d+ \|$", out, re.M)
    assert compared or re.search(r"^llama\.cpp: \S.*$", out, re.M), out
    if compared:
        assert re.search(r"^pagelm / llama\.cpp: decode [\d.]+×, TTFT [\d.]+× as fast, anonymous memory [\d.]+×$",
                         out, re.M)
        assert re.search(r"^same greedy tokens: \d of 4 before the first difference$", out, re.M)


def test_the_fresh_process_decodes_what_pagelm_decodes(smollm2_gguf):
    report = run_peer("smollm2", smollm2_gguf, 12, 5, 32, 1, threads=1, weights="mapped")
    run = report.runs["pagelm"][0]
    assert "error" not in run, run
    session = pagelm.load(smollm2_gguf, threads=1).session(max_len=32)
    tokens = [int(np.argmax(session.prefill(prompt_tokens(12))))]
    while len(tokens) < 5:
        tokens.append(int(np.argmax(session.decode(tokens[-1]))))
    assert run["tokens"] == tokens
    assert run["ttft_s"] > 0 and run["decode_tps"] > 0 and run["anonymous"] > 0


def test_bench_peer_cold_evicts_the_file_before_each_process(smollm2_gguf, capsys):
    """The first answer from each process's start, the file evicted before it (pages other processes of
    the suite map stay resident: the fraction is reported, not assumed)."""
    code = cli.main(["bench", "peer", smollm2_gguf, "--prompt-tokens", "20", "--tokens", "4", "--ctx", "64",
                     "--runs", "1", "--threads", "1", "--cold"])
    out = capsys.readouterr().out
    assert code == 0, out
    first = re.search(r"^first answer from the process's start \(load, warmup, prompt\), the file evicted before each "
                      r"process \(([\d.]+)% of it resident at most\): pagelm ([\d.]+) s", out, re.M)
    assert first or re.search(r"^llama\.cpp: \S.*$", out, re.M), out
    if first:
        assert 0 <= float(first.group(1)) <= 100 and float(first.group(2)) > 0
