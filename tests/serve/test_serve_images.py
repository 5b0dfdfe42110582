"""Images through the HTTP APIs of a Qwen3.5 with a tower: OpenAI data URLs and Ollama base64
images reach the model, the same image again costs no tower pass (image-embedding cache) and no
prefill (prefix cache), a different image of the same size at the same place is never a prefix
hit, and bad images are 400s in each protocol's error shape that leave nothing in the caches."""

from __future__ import annotations

import struct
import zlib

from serve_helpers import QUESTION, b64, openai_chat, png, usage


def png_claiming(width: int, height: int) -> bytes:
    """A 2 × 2 PNG whose header says width × height (CRC fixed)."""
    data = bytearray(png(2, 2))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_openai_images_reach_the_model_once(qwen_vision):
    text_only = openai_chat(qwen_vision)
    start = qwen_vision.ps()["image_cache"]
    first = openai_chat(qwen_vision, png(40, 40))
    assert first["status"] == 200
    assert usage(first)[0] == usage(text_only)[0] + 64 + 2  # <|vision_start|>, 64 image tokens, <|vision_end|>
    after_first = qwen_vision.ps()["image_cache"]
    assert after_first["entries"] == start["entries"] + 1 and after_first["hits"] == start["hits"]
    assert after_first["tower_passes"] == start["tower_passes"] + 1
    assert after_first["tower_seconds"] > start["tower_seconds"]

    again = openai_chat(qwen_vision, png(40, 40))
    assert again["choices"] == first["choices"]
    assert usage(again)[1] > 66  # the image and the text are restored from the prefix cache
    assert qwen_vision.ps()["image_cache"]["lookups"] == after_first["lookups"]

    elsewhere = openai_chat(qwen_vision, png(40, 40), system="Be brief.")
    assert elsewhere["status"] == 200
    cache = qwen_vision.ps()["image_cache"]
    assert cache["hits"] == after_first["hits"] + 1 and cache["entries"] == after_first["entries"]
    assert cache["tower_passes"] == after_first["tower_passes"]  # the hit cost no tower pass
    assert cache["bytes_held"] <= cache["max_bytes"] and cache["bytes_held"] >= 64 * 128 * 4


def test_a_different_image_of_the_same_size_is_no_prefix_hit(qwen_vision):
    first = openai_chat(qwen_vision, png(48, 48, seed=5), text="Describe it.")
    other = openai_chat(qwen_vision, png(48, 48, seed=6), text="Describe it.")
    assert usage(other)[0] == usage(first)[0]
    assert usage(other)[1] < 5  # at most the tokens before the image (the turn's header)
    again = openai_chat(qwen_vision, png(48, 48, seed=5), text="Describe it.")
    assert usage(again)[1] > 66 and again["choices"] == first["choices"]


def test_ollama_images_reach_the_model(qwen_vision):
    image = b64(png(40, 40, seed=9))
    with qwen_vision.client() as c:
        chat = c.post("/api/chat", json={"model": qwen_vision.model, "stream": False, "think": False,
                                         "messages": [{"role": "user", "content": QUESTION, "images": [image]}]})
        text_only = c.post("/api/chat", json={"model": qwen_vision.model, "stream": False, "think": False,
                                              "messages": [{"role": "user", "content": QUESTION}]})
        generate = c.post("/api/generate", json={"model": qwen_vision.model, "prompt": QUESTION, "think": False,
                                                 "images": [image], "stream": False})
        raw = c.post("/api/generate", json={"model": qwen_vision.model, "prompt": QUESTION, "raw": True,
                                            "images": [image], "stream": False})
        metrics = c.get("/metrics").text
        show = c.post("/api/show", json={"model": qwen_vision.model}).json()
    assert chat.status_code == 200 and generate.status_code == 200
    tokens = lambda r: r.json()["prompt_eval_count"] + r.json()["prompt_cached_count"]  # noqa: E731
    assert tokens(chat) == tokens(text_only) + 66
    assert raw.status_code == 400 and "raw prompt cannot carry images" in raw.json()["error"]
    assert "pagelm_image_cache_hits " in metrics and "pagelm_image_cache_bytes_held " in metrics
    assert "vision" in show["capabilities"]


BAD_IMAGES = [
    (png(300, 200)[:300], "truncated or corrupt"),
    (png_claiming(8000, 8000), "over the limit of 50,000,000 decoded pixels"),
    (png_claiming(0, 2), "header cannot be read"),
    (png(402, 2), "aspect ratio over 200:1"),
    (b"GIF89a" + bytes(20), "GIF image whose header"),
]


def test_bad_images_are_400s_naming_the_problem_and_leave_no_trace(qwen_vision):
    before = qwen_vision.ps()
    with qwen_vision.client() as c:
        for data, message in BAD_IMAGES:
            reply = openai_chat(qwen_vision, data)
            assert reply["status"] == 400 and message in reply["error"]["message"], reply
            assert reply["error"]["type"] == "invalid_request_error"
            r = c.post("/api/chat", json={"model": qwen_vision.model, "stream": False,
                                          "messages": [{"role": "user", "content": "?", "images": [b64(data)]}]})
            assert r.status_code == 400 and message in r.json()["error"], r.text
        many = openai_chat(qwen_vision, *[png(8, 8)] * 17)
        assert many["status"] == 400 and "more than 16 images" in many["error"]["message"]
        system = c.post("/v1/chat/completions", json={"model": qwen_vision.model, "messages": [
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,"
                                                                                      f"{b64(png(8, 8))}"}}]},
            {"role": "user", "content": "?"}]})
        assert system.status_code == 400 and "System message cannot contain images" in system.text
    after = qwen_vision.ps()
    assert after["image_cache"] == before["image_cache"]
    assert after["prefix_cache"]["entries"] == before["prefix_cache"]["entries"]
    assert after["requests"]["failed"] == before["requests"]["failed"]  # refused before reaching the engine
    assert openai_chat(qwen_vision, png(40, 40))["status"] == 200
