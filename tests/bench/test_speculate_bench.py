"""`pagelm bench speculate` end to end on SmolLM2, briefly: its lines, and every speculative answer
compared with its plain one."""

import re

from pagelm import cli


def test_bench_speculate_prints_its_lines_and_no_differing_answer(smollm2_gguf, capsys):
    code = cli.main(["bench", "speculate", smollm2_gguf, "--tasks", "edit,chat", "--tokens", "12", "--runs", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    for task in ("edit", "edit seeded", "edit \\+ prediction", "edit \\+ its answer", "chat", "chat seeded",
                 "chat \\+ its answer"):
        assert re.search(rf"^{task}: \d+\.\d\d× plain$", out, re.M), task
    assert re.search(r"^differing answers: 0 of 7$", out, re.M)
    for task in ("edit", "chat"):  # 12 tokens of its own answer: 5 then 7 tokens a pass, every draft kept
        passes = re.search(rf"^\| {task} \+ its answer \| greedy \|(?: [\d.]+ \|){{2}} ([\d.]+) \|", out, re.M)
        assert float(passes.group(1)) == 5.5, task
    passes = re.search(r"^\| edit \+ prediction \| greedy \|(?: [\d.]+ \|){2} ([\d.]+) \|", out, re.M)
    assert float(passes.group(1)) > 1  # the prediction's drafts were kept
    assert re.search(r"^llama-server: not on PATH, not compared$|^\| edit \|(?: [\d.]+ \|){2} ", out, re.M)


def test_bench_speculate_refuses_unknown_tasks(capsys):
    assert cli.main(["bench", "speculate", "smollm2-135m", "--tasks", "edit,poetry"]) != 0
    assert "--tasks must be distinct names among edit,extract,summarize,chat" in capsys.readouterr().err


def test_bench_speculate_drafts_from_a_draft_model(smollm2_gguf, capsys):
    code = cli.main(["bench", "speculate", smollm2_gguf, "--tasks", "chat", "--tokens", "12", "--runs", "1",
                     "--draft", smollm2_gguf])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "drafts from smollm2" in out and re.search(r"^differing answers: 0 of 3$", out, re.M)
    passes = re.search(r"^\| chat \| greedy \|(?: [\d.]+ \|){2} ([\d.]+) \|", out, re.M)
    assert float(passes.group(1)) > 2  # the model drafting for itself: its greedy drafts kept


def test_bench_speculate_drafts_from_the_mtp_layer(qwen35_mtp_chat_gguf, qwen35_chat_gguf, capsys):
    code = cli.main(["bench", "speculate", qwen35_mtp_chat_gguf, "--tasks", "chat", "--tokens", "12", "--runs", "1",
                     "--mtp"])
    out = capsys.readouterr().out
    assert code == 0 and "the file's MTP layer" in out and "not compared (MTP drafts)" in out
    assert "differing answers: 0 of 3" in out
    assert cli.main(["bench", "speculate", qwen35_chat_gguf, "--tasks", "chat", "--tokens", "4", "--mtp"]) != 0
    assert "no multi-token-prediction layer" in capsys.readouterr().err


def test_bench_speculate_serves_parallel_edits_with_speculation_off_and_on(smollm2_gguf, capsys):
    code = cli.main(["bench", "speculate", smollm2_gguf, "--tasks", "chat", "--tokens", "12", "--runs", "1",
                     "--parallel", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^aggregate tok/s: speculate off \d+\.\d, auto \d+\.\d \(\d+\.\d\d×\)$", out, re.M)
    assert re.search(r"^extra anonymous memory per speculating sequence: -?\d+\.\d MiB", out, re.M)
    assert re.search(r"^served answers differing with speculation: 0 of 2$", out, re.M)


def test_bench_speculate_refuses_one_client(capsys):
    assert cli.main(["bench", "speculate", "smollm2-135m", "--parallel", "1"]) != 0
    assert "--parallel must be 2 to 8 (clients at once), got 1" in capsys.readouterr().err
