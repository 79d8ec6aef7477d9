"""How long freeing a worker's batch stalls the other threads of the training process (the GIL), with and without
``EncodedBatch.release`` giving the pages back first (``madvise(MADV_REMOVE)``, off the GIL).

    python scripts/bench_batch_release.py                 # 40 batches of 20 MB from 2 DataLoader workers
    python scripts/bench_batch_release.py --mb 20 --batches 40 --workers 2

DataLoader workers send ``EncodedBatch`` es holding ``--mb`` MB of bytes (an ImageNet batch of 256 JPEGs is ~20 MB) to
this process through torch's shared memory, as the ``decode: gpu`` training loader does. All batches are received
first; then the main thread releases them one by one (5 ms apart), while a probe thread runs a tight Python loop and
records every gap longer than 0.2 ms: the time it could not get the GIL. Printed per mode: the probe's stalls per
release in ms (total and largest). Runs on any machine (Linux for the page hand-back); no GPU needed.
"""

from __future__ import annotations

import functools
import threading
import time

import torch

from mixlab.datamodules import imagenet_gpu
from mixlab.eval.common import OneLineParser


class _Items(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        share = self.n // (info.num_workers if info else 1)
        return iter(range(share))


def _batch(nbytes: int, items: list) -> imagenet_gpu.EncodedBatch:
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)  # every page written, as the JPEG bytes are
    return imagenet_gpu.EncodedBatch(data, torch.arange(257) * (nbytes // 256), torch.zeros(256, dtype=torch.int64),
                                     ["k"] * 256, {"crop": torch.zeros(256, 4, dtype=torch.int64)}, True)


def stalls_per_release(mb: float, batches: int, workers: int, give_back: bool) -> tuple[float, float, int]:
    """``(stall ms per release, largest stall ms, batches released)`` of :func:`main`'s measurement."""
    loader = torch.utils.data.DataLoader(_Items(batches), batch_size=1, num_workers=workers,
                                         collate_fn=functools.partial(_batch, int(mb * 1e6)))
    received = list(loader)
    for batch in received:  # pages_held: release leaves the pages to the last reference, as without the hand-back
        batch.pages_held = not give_back
    gaps: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            if now - last > 2e-4:
                gaps.append(now - last)
            last = now

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    time.sleep(0.1)
    start = len(gaps)
    try:
        for batch in received:
            batch.release()
            time.sleep(0.005)
    finally:
        stop.set()
        thread.join()
    stalls = gaps[start:]
    return 1e3 * sum(stalls) / max(1, len(received)), 1e3 * max(stalls, default=0.0), len(received)


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=20.0, help="MB per batch (default 20: 256 ImageNet JPEGs)")
    p.add_argument("--batches", type=int, default=40, help="batches released per mode")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    a = p.parse_args(argv)
    for name, value, least in (("--mb", a.mb, 0.01), ("--batches", a.batches, 1), ("--workers", a.workers, 1)):
        if value < least:
            p.error(f"{name} must be >= {least}; got {value}")
    for give_back in (False, True):
        per, largest, n = stalls_per_release(a.mb, a.batches, a.workers, give_back)
        how = "pages given back first (madvise)" if give_back else "freed by the last reference"
        print(f"{how}: {n} releases of {a.mb:g} MB, other threads stalled {per:.2f} ms per release "
              f"(largest {largest:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
