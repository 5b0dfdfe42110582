"""`pagelm run` as a user types it: real processes, the real SmolLM2 file from the store."""

import json
import subprocess
import sys

import pytest


def _run(*args, stdin=None):
    result = subprocess.run([sys.executable, "-m", "pagelm", "run", *args], input=stdin,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result


def test_one_shot_answers_with_paris_on_stdout_only(smollm2_gguf):
    result = _run(smollm2_gguf, "What is the capital of France?", "--max-tokens", "32", "--stats")
    assert "Paris" in result.stdout
    assert "loading" not in result.stdout and "tok/s" in result.stderr


def test_a_lone_prompt_goes_to_the_default_model(smollm2_gguf):
    # the fixture has pulled smollm2-135m into the default store, so this finds it there
    result = _run("What is the capital of France?", "--max-tokens", "32")
    assert "Paris" in result.stdout and "smollm2-135m.gguf" in result.stderr


def test_json_is_the_last_line(smollm2_gguf):
    last = _run(smollm2_gguf, "Say hi", "--json", "--max-tokens", "8").stdout.strip().splitlines()[-1]
    report = json.loads(last)
    assert report["completion_tokens"] == len(report["token_ids"]) <= 8
    assert report["prompt_tokens"] > 0 and isinstance(report["content"], str) and report["reasoning"] == ""


def test_the_repl_keeps_history_and_reuses_the_processed_prompt(smollm2_gguf):
    script = "What is the capital of France?\n/stats\nAnd of Italy?\n/stats\n/set temperature x\n/nonsense\n/bye\n"
    result = _run(smollm2_gguf, "--max-tokens", "24", stdin=script)
    assert "Paris" in result.stdout and "Rome" in result.stdout
    stats = [line for line in result.stderr.splitlines() if line.startswith("[prompt")]
    assert "(0 reused)" in stats[0] and "(0 reused)" not in stats[1]
    assert "not set" in result.stderr and "unknown command" in result.stderr


@pytest.mark.parametrize("embedding", ["mapped", "dense"])
def test_both_embedding_modes_give_the_same_answer(smollm2_gguf, embedding):
    out = _run(smollm2_gguf, "Name a color.", "--json", "--max-tokens", "12", "--embedding", embedding).stdout
    tokens = json.loads(out.strip().splitlines()[-1])["token_ids"]
    reference = json.loads(_run(smollm2_gguf, "Name a color.", "--json", "--max-tokens", "12").stdout
                           .strip().splitlines()[-1])["token_ids"]
    assert tokens == reference


@pytest.fixture(scope="module")
def synthetic_qwen(tmp_path_factory):
    """A random Qwen3.5-0.8B-geometry model with the real vocabulary and chat template."""
    path = str(tmp_path_factory.mktemp("qwen") / "qwen3.5-0.8b.gguf")
    subprocess.run([sys.executable, "-m", "pagelm", "synth", "--shape", "qwen3.5-0.8b", "--layer-type", "Q4_0",
                    "--quiet", path], check=True, capture_output=True)
    return path


def test_think_on_returns_reasoning_apart_and_think_off_answers_directly(synthetic_qwen):
    def ask(flag):
        out = _run(synthetic_qwen, "Hello there", flag, "--json", "--max-tokens", "8").stdout
        return json.loads(out.strip().splitlines()[-1])

    thinking, direct = ask("--think"), ask("--no-think")
    # on: the prompt leaves "<think>\n" open, so what follows is reasoning until "</think>"
    assert thinking["reasoning"] and thinking["content"] == ""
    # off: the template closes an empty think block ("<think>\n\n</think>\n\n", 2 more tokens)
    assert direct["content"] and direct["reasoning"] == ""
    assert direct["prompt_tokens"] == thinking["prompt_tokens"] + 2


def test_images_join_the_prompt_one_shot_and_in_the_repl(qwen35_chat_gguf, tmp_path):
    import re

    from PIL import Image

    from pagelm.tools.synth_tower import SHAPES, write_mmproj

    tower, image, bad = tmp_path / "tower.gguf", tmp_path / "square.png", tmp_path / "bad.png"
    write_mmproj(str(tower), SHAPES["qwen3.5-tiny-chat"])
    Image.new("RGB", (40, 40), (10, 200, 30)).save(image)
    bad.write_bytes(b"hello")
    flags = ("--mmproj", str(tower), "--json", "--max-tokens", "2")

    def prompt_tokens(*more: str) -> int:
        out = _run(qwen35_chat_gguf, "What is it?", *flags, *more).stdout
        return json.loads(out.strip().splitlines()[-1])["prompt_tokens"]

    # <|vision_start|>, 64 image tokens (the smallest image by default), <|vision_end|>
    text_only = prompt_tokens()
    assert prompt_tokens("--image", str(image)) == text_only + 66
    assert prompt_tokens("--image", str(image), "--image-min-tokens", "4") == text_only + 4 + 2
    refused = subprocess.run([sys.executable, "-m", "pagelm", "run", qwen35_chat_gguf, "What?", *flags,
                              "--image", str(bad)], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and f"{bad}: not a PNG" in refused.stderr

    script = f"/image {bad}\n/image {image}\nWhat is it?\n/stats\n/bye\n"
    repl = _run(qwen35_chat_gguf, "--mmproj", str(tower), "--max-tokens", "2", stdin=script).stderr
    assert "(no image:" in repl and "(image 1 joins the next message)" in repl
    assert int(re.search(r"\[prompt (\d+) tokens", repl).group(1)) > 66


def test_speculation_gives_the_same_answer_and_its_stats(smollm2_gguf):
    from pagelm.chat.cli import SPECULATE_MODES
    from pagelm.engine.speculate import MODES

    assert SPECULATE_MODES == MODES
    prompt = "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon"
    answers, drafted, accepted = _answers_with_speculation(smollm2_gguf, prompt, "lookup", 40)
    assert answers["lookup"] == answers["off"] and drafted >= accepted > 0


def _answers_with_speculation(path: str, prompt: str, mode: str, tokens: int) -> tuple[dict, int, int]:
    """The token ids of `pagelm run` with --speculate `mode` and off, and the drafted and accepted
    tokens its --stats line reports (none with off)."""
    answers = {}
    for m in (mode, "off"):
        result = _run(path, prompt, "--json", "--stats", "--max-tokens", str(tokens), "--speculate", m)
        answers[m] = json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]
        stats = [line for line in result.stderr.splitlines() if line.startswith("[speculation:")]
        assert bool(stats) == (m != "off")
        if stats:
            drafted, accepted = (int(w) for w in stats[0].split()[1:4:2])
    return answers, drafted, accepted


def test_the_files_mtp_layer_drafts_and_gives_the_same_answer(qwen35_mtp_chat_gguf, qwen35_chat_gguf):
    prompt = "List the numbers from one to twenty."
    answers, drafted, accepted = _answers_with_speculation(qwen35_mtp_chat_gguf, prompt, "mtp", 24)
    assert answers["mtp"] == answers["off"] and len(answers["off"]) == 24
    assert drafted > 0 and drafted >= accepted
    for flags, error in ((("--speculate", "mtp"), "no multi-token-prediction layer"),
                         (("--speculate", "mtp", "--draft", qwen35_chat_gguf), "not mtp")):
        refused = subprocess.run([sys.executable, "-m", "pagelm", "run", qwen35_chat_gguf, prompt, *flags],
                                 capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2 and error in refused.stderr, refused.stderr


def test_a_draft_model_gives_the_same_answer_and_another_vocabulary_is_refused(smollm2_gguf, qwen35_chat_gguf,
                                                                               harmony_gguf):
    prompt = "Name the planets of the solar system."
    plain = _run(smollm2_gguf, prompt, "--json", "--max-tokens", "32", "--speculate", "off")
    drafted = _run(smollm2_gguf, prompt, "--json", "--stats", "--max-tokens", "32", "--draft", smollm2_gguf)
    ids = [json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] for r in (plain, drafted)]
    assert ids[0] == ids[1]
    [stats] = [line for line in drafted.stderr.splitlines() if line.startswith("[speculation:")]
    drafted_n, accepted = (int(w) for w in stats.split()[1:4:2])
    assert accepted >= drafted_n // 2 > 0, stats  # the model drafting for itself
    for draft, says in ((qwen35_chat_gguf, "a vocabulary of 248320 tokens"), (harmony_gguf, "token 248100 is")):
        refused = subprocess.run([sys.executable, "-m", "pagelm", "run", smollm2_gguf if draft == qwen35_chat_gguf
                                  else qwen35_chat_gguf, "Hi", "--draft", draft], capture_output=True, text=True,
                                 timeout=600)
        assert refused.returncode != 0 and says in refused.stderr and "Traceback" not in refused.stderr
    off = subprocess.run([sys.executable, "-m", "pagelm", "run", smollm2_gguf, "Hi", "--draft", smollm2_gguf,
                          "--speculate", "off"], capture_output=True, text=True, timeout=600)
    assert off.returncode != 0 and "--draft" in off.stderr and "not off" in off.stderr
