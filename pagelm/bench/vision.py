"""`pagelm bench vision`: what an image costs a Qwen3.5 server, per tower geometry and image size:
its tokens, the tower's time, TTFT, TTFT of the same image again, and the peak anonymous memory added.

Owns the images it sends (seeded photographs-like JPEGs) and that measurement; one `pagelm serve`
per geometry, its memory read from /proc and its tower seconds from `/api/ps`.
"""

from __future__ import annotations

import base64
import io
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from pagelm.bench.inputs import MIB, display_name
from pagelm.bench.report import Panel, bar_chart, markdown_table
from pagelm.bench.server import ServerConfig, ServerProcess, progress
from pagelm.errors import PagelmError

# (label, width, height); the last is a 12-megapixel phone photo, resized down to the token cap
SIZES = (("640×480", 640, 480), ("1080×720", 1080, 720), ("1920×1080", 1920, 1080),
         ("4032×3024 (token cap)", 4032, 3024))
WARMUP = (320, 240)  # one image first, so every weight page is mapped and every kernel compiled
QUESTION, FOLLOW_UP = "Describe this image in one sentence.", "What is in the top left corner?"


def photo_jpeg(width: int, height: int, seed: int) -> bytes:
    """A seeded image with a photograph's statistics (smooth shading, edges, fine grain) as JPEG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        fx, fy = rng.uniform(1, 6, 2) * np.pi / np.array([width, height])
        wave = np.sin(x * np.float32(fx) + y * np.float32(fy) + np.float32(rng.uniform(0, 6)))
        edge = (x * np.float32(rng.uniform(-1, 1)) + y * np.float32(rng.uniform(-1, 1))
                > np.float32(rng.uniform(0, width))).astype(np.float32)
        grain = rng.normal(0, 6, (height, width)).astype(np.float32)
        channels.append(128 + 70 * wave + 40 * edge + grain)
    pixels = np.clip(np.stack(channels, axis=-1), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=88)
    return out.getvalue()


def _reset_peak(pid: int) -> None:
    """Make the process's VmHWM its current RSS (Linux: clear_refs 5), so the next peak is this request's."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _image_message(jpeg: bytes, question: str) -> list[dict]:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def _ttft(server: ServerProcess, model: str, messages: list[dict]) -> tuple[float, dict]:
    """Seconds from sending the request to its first streamed token, and the usage it ends with."""
    body = {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}
    start = time.perf_counter()
    stream = server.stream("/v1/chat/completions", body)
    if stream.status != 200:
        raise PagelmError(f"image request on {model} failed: HTTP {stream.status} {list(stream.events)}")
    first, usage = None, {}
    for event in stream.events:
        if first is None and event.get("choices") and event["choices"][0]["delta"].get("content") is not None:
            first = time.perf_counter() - start
        usage = event.get("usage") or usage
    if first is None:
        raise PagelmError(f"image request on {model} streamed no token")
    return first, usage


def measure_image(server: ServerProcess, model: str, jpeg: bytes) -> dict:
    """One image, three requests: first (tower + prefill), the same request again (both caches), and
    the same image with another question (no tower pass; prefilled from the prefix cache's last
    checkpoint before the question)."""
    before, stats_before = server.memory(), server.stats()
    cache_before = stats_before["image_cache"]
    _reset_peak(server.pid)
    ttft, usage = _ttft(server, model, _image_message(jpeg, QUESTION))
    after, stats = server.memory(), server.stats()
    again, usage_again = _ttft(server, model, _image_message(jpeg, QUESTION))
    follow_up, _ = _ttft(server, model, _image_message(jpeg, FOLLOW_UP))
    end_stats = server.stats()
    cache = stats["image_cache"]
    file_growth = max(0, after.file_rss - before.file_rss)  # pages first touched now are not anonymous
    return {"prompt_tokens": usage["prompt_tokens"],
            "tower_s": cache["tower_seconds"] - cache_before["tower_seconds"],
            "tower_passes": end_stats["image_cache"]["tower_passes"] - cache_before["tower_passes"],
            "ttft_s": ttft, "again_s": again, "follow_up_s": follow_up,
            "again_cached": usage_again["prompt_tokens_details"]["cached_tokens"],
            "peak_added_mib": (after.peak_rss - before.rss - file_growth) / MIB,
            "anon_added_mib": (after.anonymous - before.anonymous) / MIB,
            "caches_added_mib": (cache["bytes_held"] - cache_before["bytes_held"] + stats["prefix_cache"]["bytes_held"]
                                 - stats_before["prefix_cache"]["bytes_held"]) / MIB}


@dataclass
class GeometryVision:
    model: str
    runs: dict[str, list[dict]] = field(default_factory=dict)  # image size label -> one result per image
    baseline_anon_mib: float = 0.0
    end_anon_mib: float = 0.0
    end_caches_mib: float = 0.0

    def median(self, label: str, key: str) -> float:
        return statistics.median(r[key] for r in self.runs[label])


@dataclass
class VisionReport:
    geometries: list[GeometryVision]
    n_runs: int
    image_cache_mib: int
    sizes: tuple[tuple[str, int, int], ...] = SIZES

    def table(self) -> str:
        rows = []
        for g in self.geometries:
            for label, width, height in self.sizes:
                megapixels = width * height / 1e6
                peak = g.median(label, "peak_added_mib")
                ttft, again = g.median(label, "ttft_s"), g.median(label, "again_s")
                rows.append([g.model, label, str(g.runs[label][0]["prompt_tokens"]),
                             f"{g.median(label, 'tower_s'):.2f}", f"{ttft:.2f}", f"{again:.3f}",
                             f"{100 * again / ttft:.1f} %", f"{g.median(label, 'follow_up_s'):.2f}",
                             f"{peak:.0f}", f"{peak / megapixels:.0f}", f"{g.median(label, 'anon_added_mib'):.0f}",
                             f"{g.median(label, 'caches_added_mib'):.0f}"])
        return markdown_table(["geometry", "image", "prompt tokens", "tower s", "TTFT s", "again TTFT s",
                               "again / first", "new question TTFT s", "peak anon added MiB", "MiB per megapixel",
                               "anon kept MiB", "caches added MiB"], rows, align="llrrrrrrrrrr")

    def summary(self) -> list[str]:
        lines = []
        for g in self.geometries:
            lines.append(f"{g.model}: anonymous memory after all images {g.end_anon_mib - g.baseline_anon_mib:.0f} "
                         f"MiB above the server before its first image; the caches hold {g.end_caches_mib:.0f} MiB "
                         f"of it (image embeddings ≤ {self.image_cache_mib} MiB, plus the prefix cache's "
                         f"checkpoints); tower passes: one per image (repeats: "
                         f"{sum(r['tower_passes'] for runs in g.runs.values() for r in runs) - self.n_runs * len(self.sizes)}"
                         f" extra)")
        return lines

    def markdown(self) -> str:
        lines = "\n".join(f"- {line}" for line in self.summary())
        return (f"One `pagelm serve --mmproj TOWER` per geometry (weights mapped, bf16, prefix cache on, image "
                f"cache {self.image_cache_mib} MiB); a {WARMUP[0]}×{WARMUP[1]} image first, then per size "
                f"{self.n_runs} seeded photograph-like JPEG(s), each sent three times, streamed, 2 greedy tokens: "
                f"first (tower + prefill: TTFT as the client sees it), again (the same request: the prefix cache, "
                f"keyed by the image's hash, holds all of it) and with a new question after the image (no tower "
                f"pass: the embedding cache; the prefix cache restores up to its last checkpoint before the "
                f"question, a multiple of --checkpoint-interval 512, and the rest is prefilled). Tower s is the server's own tower time "
                f"(`/api/ps` image_cache.tower_seconds). Peak anon added = VmHWM after the first request "
                f"(reset by `/proc/PID/clear_refs` just before it) − RSS before it − file pages first touched "
                f"(none after the warm-up); per megapixel of the image as sent. Anon kept = anonymous memory "
                f"after the first request − before; caches added = what the image-embedding cache and the "
                f"prefix cache (its checkpoints) hold more after it. Medians "
                f"of {self.n_runs} image(s).\n\n{self.table()}\n\n{lines}\n")

    def chart(self, path: str) -> str:
        labels = [label.split(" ")[0] for label, _, _ in self.sizes]
        panels = [Panel("peak anonymous memory added", "MiB", labels,
                        {g.model: [g.median(label, "peak_added_mib") for label, _, _ in self.sizes]
                         for g in self.geometries}),
                  Panel("TTFT, first and again", "s", labels,
                        {**{f"{g.model} first": [g.median(label, "ttft_s") for label, _, _ in self.sizes]
                            for g in self.geometries},
                         **{f"{g.model} again": [g.median(label, "again_s") for label, _, _ in self.sizes]
                            for g in self.geometries}})]
        return bar_chart(path, panels, "pagelm serve: one image, per tower geometry and size")


def run_vision(models: list[tuple[str, str, str]], n_runs: int, image_cache_mib: int = 256,
               sizes: tuple[tuple[str, int, int], ...] = SIZES) -> VisionReport:
    """`models` are (name, model path, tower path) triples; `sizes` (label, width, height) of the images."""
    report = VisionReport([], n_runs, image_cache_mib, sizes)
    for name, path, tower in models:
        result = GeometryVision(display_name(name))
        flags = ["--mmproj", tower, "--image-cache-mib", str(image_cache_mib)]
        with ServerProcess(path, ServerConfig(), flags) as server:
            model = display_name(path)
            progress(f"vision {result.model}: warm-up image")
            _ttft(server, model, _image_message(photo_jpeg(*WARMUP, seed=0), QUESTION))
            result.baseline_anon_mib = server.memory().anonymous / MIB
            for run in range(n_runs):
                for i, (label, width, height) in enumerate(sizes):
                    progress(f"vision {result.model}: {label}, image {run + 1}/{n_runs}")
                    jpeg = photo_jpeg(width, height, seed=1 + run * len(sizes) + i)
                    result.runs.setdefault(label, []).append(measure_image(server, model, jpeg))
            stats = server.stats()
            result.end_anon_mib = server.memory().anonymous / MIB
            result.end_caches_mib = (stats["image_cache"]["bytes_held"] + stats["prefix_cache"]["bytes_held"]) / MIB
        report.geometries.append(result)
    return report
