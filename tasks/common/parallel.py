"""``[fn(x) for x in items]`` on a thread pool: how the storage layer moves many files at once.

    from tasks.common.parallel import parallel_map

    sizes = parallel_map(lambda p: p.stat().st_size, paths)   # in order; the first failure is raised

Standard library only.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Callable, Iterable, TypeVar

FILE_WORKERS = 8  # files transferred at once by upload_dir/download_dir

T = TypeVar("T")
R = TypeVar("R")


def parallel_map(fn: Callable[[T], R], items: Iterable[T], max_workers: int = FILE_WORKERS) -> list[R]:
    """``[fn(x) for x in items]`` on a thread pool; the first failure cancels the rest and is raised."""
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        futures = [pool.submit(fn, x) for x in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                raise f.exception()
        return [f.result() for f in futures]
