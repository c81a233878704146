"""Per-tensor quantization work in a local process pool: numpy-only workers with one BLAS thread each.

Results are gathered by tensor name, so the output bytes do not depend on the number of workers.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from accel.converters.sources import one_line
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
def workers(jobs: int, ray_address: str | None = None) -> Iterator[Workers | None]:
    """The local pool of `jobs` processes (None for one: the caller works in-process), or with `ray_address` the
    CPUs of a Ray cluster (`ray_workers`)."""
    if ray_address is not None:
        with ray_workers(ray_address, jobs) as cluster:
            yield cluster
        return
    with worker_pool(jobs) as pool:
        yield None if pool is None else Workers(pool.submit, jobs)


@contextlib.contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """Keep this process's SIGINT and SIGTERM handlers through `ray.init`, which replaces them: its SIGTERM handler
    exits with status 15 and its native one aborts, where accel's turns SIGTERM into an exception that cancels the
    tasks, shuts Ray down and exits 143 with one line. Ray's Python-level calls are ignored while the block runs,
    and the handlers are set again after it, over what Ray's native code installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    original = signal.signal

    def keep(sig: int, handler: Any) -> Any:
        return signal.getsignal(sig) if sig in ours else original(sig, handler)

    signal.signal = keep
    try:
        yield
    finally:
        signal.signal = original
        for sig, handler in ours.items():
            if handler is not None:
                original(sig, handler)


# The logger of Ray's notice that it turned token authentication on for a new local instance (its default).
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextlib.contextmanager
def _quiet_auth_notice(address: str) -> Iterator[None]:
    """Starting a local instance, Ray logs on stderr that it chose token authentication (the default, which is
    kept): a line on every `--ray local` run that asks nothing of the user. Its logger is held at ERROR while the
    instance starts; connecting to a cluster logs as it always does."""
    if address != "local":
        yield
        return
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _accel_version() -> str:
    from accel import __version__

    return __version__


@contextlib.contextmanager
def ray_workers(address: str, jobs: int) -> Iterator[Workers]:
    """The per-tensor work on a Ray cluster (design.md §8: an existing engine, nothing home-made). `address` is
    what `ray.init` takes ("auto", "ray://head:10001", "host:6379"), or "local" for a Ray instance of `jobs` CPUs
    started for this run. The cluster's workers import accel: its version there must be this one. Each task takes
    one CPU and one BLAS thread; results come back by tensor name, so the bytes are those of the local pool."""
    try:
        import ray
        from ray.exceptions import RayTaskError
    except ImportError:
        raise AccelError("--ray needs Ray installed (pip install 'ray[default]')") from None
    env = {"env_vars": {k: "1" for k in _THREAD_VARS}}
    pending: list[Any] = []
    try:
        with _own_signal_handlers(), _quiet_auth_notice(address):
            try:
                if address == "local":
                    ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False, configure_logging=False,
                             runtime_env=env)
                else:
                    ray.init(address=address, log_to_driver=False, configure_logging=False, runtime_env=env)
            except Exception as exc:  # noqa: BLE001 - ConnectionError, ValueError (a malformed address), ...
                raise AccelError(f"--ray {address}: cannot start or reach a Ray cluster: {one_line(exc)}") from None
        theirs = ray.get(ray.remote(num_cpus=1)(_accel_version).remote())
        if theirs != _accel_version():
            raise AccelError(f"--ray {address}: the cluster's workers run accel {theirs}, this is accel "
                             f"{_accel_version()}: install the same version there")
        remote_encode = ray.remote(num_cpus=1)(encode_one)

        def submit(fn: Callable[..., Any], *args: Any) -> Future:
            if fn is not encode_one:
                raise ValueError("the Ray workers run encode_one only")
            ref = remote_encode.remote(*args)
            pending.append(ref)
            out: Future = Future()

            def settle(done: Future) -> None:
                try:
                    out.set_result(done.result())
                except RayTaskError as exc:  # the task's own exception (an AccelError), not Ray's wrapper of it
                    out.set_exception(exc.cause if isinstance(exc.cause, BaseException) else exc)
                except BaseException as exc:  # noqa: BLE001 - handed on to whoever waits on the result
                    out.set_exception(exc)

            ref.future().add_done_callback(settle)
            return out

        yield Workers(submit, max(1, int(ray.cluster_resources().get("CPU", 1))))
    except BaseException:
        for ref in pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        raise
    finally:
        ray.shutdown()  # also after an interrupted or failed start
