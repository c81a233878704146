"""Per-tensor quantization work in a local process pool: numpy-only workers with one BLAS thread each.

Results are gathered by tensor name, so the output bytes do not depend on the number of workers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from accel.errors import AccelError
from accel.quantize.methods import Encoded, WeightSettings, get_weight_method

_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class FixedHessian:
    """The one Hessian a worker needs, already read and checked in the parent (mmaps do not cross processes)."""

    def __init__(self, name: str, hessian: np.ndarray):
        self.name, self.hessian = name, hessian

    def get(self, name: str, in_features: int) -> np.ndarray:
        assert name == self.name and self.hessian.shape == (in_features, in_features)
        return self.hessian


def encode_one(method: str, name: str, weight: np.ndarray, settings: WeightSettings) -> Encoded:
    try:
        return get_weight_method(method).encode(name, weight, settings)
    except ValueError as exc:
        raise AccelError(f"tensor '{name}': {exc}") from None


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def worker_pool(jobs: int) -> Iterator[Executor | None]:
    """A spawn-based pool of `jobs` workers (None for jobs <= 1: the caller works in-process).

    When the block raises (an error, Ctrl-C, or SIGTERM, which the CLI turns into an exception), the queued work is
    cancelled and the workers are stopped at once: a plain `with ProcessPoolExecutor()` would first wait for every
    tensor already submitted, minutes on a real model, and a parent killed meanwhile left its workers running."""
    if jobs <= 1:
        yield None
        return
    saved = {k: os.environ.get(k) for k in _THREAD_VARS}
    os.environ.update({k: "1" for k in _THREAD_VARS})  # read by the workers' numpy at import
    try:
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
        try:
            yield pool
        except BaseException:
            stop_pool(pool)
            raise
        pool.shutdown(wait=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the workers now (what has started is abandoned)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())  # CPython keeps them here (3.9-3.13)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in workers:
        process.terminate()
    for process in workers:
        process.join(timeout=5)



@dataclass(frozen=True)
class Workers:
    """Where quantize sends its per-tensor work: `submit(encode_one, ...)` gives a Future; `count` workers."""

    submit: Callable[..., Future]
    count: int


@contextlib.contextmanager
def workers(jobs: int) -> Iterator[Workers | None]:
    """The local pool of `jobs` processes (None for one: the caller works in-process)."""
    with worker_pool(jobs) as pool:
        yield None if pool is None else Workers(pool.submit, jobs)

