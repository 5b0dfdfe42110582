"""Peak anonymous memory of each step of one image, in process: decode and resize, pixel rows, the
tower pass, the prefill of its tokens (not a test; `pagelm bench vision` measures whole requests).

    .venv/bin/python bench/image_peaks.py qwen3.5-0.8b 640 480

Each step starts from a trimmed heap with VmHWM reset (Linux clear_refs 5); file pages the step
touched for the first time are not counted.
"""

from __future__ import annotations

import argparse
import time

import pagelm
from pagelm.runtime import heap
from pagelm.bench.inputs import MIB, model_path, tower_path
from pagelm.bench.vision import WARMUP, photo_jpeg
from pagelm.measure.memory import read_memory
from pagelm.vision.inputs import IMAGE_PAD, prepare_image


def step(name: str, fn):
    heap.trim()
    before = read_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    result = fn()
    seconds, after = time.perf_counter() - start, read_memory()
    file_growth = max(0, after.file_rss - before.file_rss)
    print(f"{name:>18}: peak +{(after.peak_rss - before.rss - file_growth) / MIB:4.0f} MiB, kept "
          f"+{(after.anonymous - before.anonymous) / MIB:4.0f} MiB, {seconds:5.1f} s", flush=True)
    return result


def prompt_of(image) -> list[int]:
    return [1] * 5 + [IMAGE_PAD] * image.tokens + [2] * 15  # a few text tokens around the image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", help="a synthetic Qwen3.5 shape with a tower (qwen3.5-0.8b, -2b, -4b, -9b)")
    parser.add_argument("width", type=int)
    parser.add_argument("height", type=int)
    parser.add_argument("--glibc-default", action="store_true",
                        help="keep glibc's moving mmap threshold (skip pagelm.runtime.heap.map_large_blocks): the old peaks")
    args = parser.parse_args()
    if args.glibc_default:
        heap.map_large_blocks = lambda: False
    model = pagelm.load(model_path(args.shape), mmproj=tower_path(args.shape))
    warm = prepare_image(photo_jpeg(*WARMUP, seed=0), model.tower.config)
    step("warm-up prefill", lambda: model.session().prefill(prompt_of(warm), [warm]))
    jpeg = photo_jpeg(args.width, args.height, seed=1)
    image = step(f"decode {args.width}×{args.height}", lambda: prepare_image(jpeg, model.tower.config))
    rows = step("pixel rows", image.rows)
    step("tower", lambda: model.tower.encode(rows.rows, rows.grid))
    model.image_embedding(image)  # into the image cache, so that the prefill below runs no tower pass
    session = model.session()  # its state (KV for the whole context) is not the prefill's
    step(f"prefill {len(prompt_of(image))} tokens", lambda: session.prefill(prompt_of(image), [image]))


if __name__ == "__main__":
    main()
