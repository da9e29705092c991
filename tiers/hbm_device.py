"""Streams, events and pinned host memory for the HBM tier and the client GPU path.

Two implementations behind one small interface, chosen by :func:`choose_device`:

- CUDA: a ``torch.cuda.Stream`` per lane (never the default stream), ``torch.cuda.Event``
  (blocking-sync, so a waiting thread sleeps instead of spinning a core), host memory pinned in
  place with ``cudaHostRegister`` so copies from and to it are DMA.
- Emulated: one thread per stream runs submitted work in FIFO order; an event is a
  ``threading.Event`` recorded by the stream thread; ``wait_event`` blocks the stream thread.
  CUDA semantics are kept exactly: work on one stream runs in order, a stream that waits on an
  event runs nothing submitted after the wait until the event fires, and an event fires only
  after everything submitted before it on its stream finished.

Ordering code above this layer (``HbmTier``'s per-slot hazards, the client's per-layer
events) is the same for both, so CI exercises it on the emulated device.

An error on an emulated stream fails the op it belongs to (its next recorded event carries
it) and every op that waited on that event, so a failed copy never passes for a good one.
"""

from __future__ import annotations

import enum
import queue
import threading
from dataclasses import dataclass
from collections.abc import Callable

from kvstore.tiers.base import TierError, CopyHandle


class DeviceKind(enum.Enum):
    CUDA = "cuda"
    EMULATED = "emulated"


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    kind: DeviceKind
    index: int = -1
    reason: str = ""  # why emulated (empty for CUDA)

    @property
    def emulated(self) -> bool:
        return self.kind is DeviceKind.EMULATED

    @property
    def name(self) -> str:
        return f"cuda:{self.index}" if self.kind is DeviceKind.CUDA else "emulated"


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def choose_device(device: str | int = "auto") -> DeviceChoice:
    """``"auto"``: CUDA device 0 when torch sees one, else emulated (with the reason);
    ``"emulated"``: always emulated; an index (int or digits): that CUDA device or TierError,
    since an operator who names a GPU must not silently get an emulation."""
    spec = str(device).strip().lower()
    if spec == "emulated":
        return DeviceChoice(DeviceKind.EMULATED, reason="emulated by configuration (device = 'emulated')")
    if spec not in ("auto", "cuda") and not spec.removeprefix("cuda:").isdigit():
        raise ValueError(f"device: expected 'auto', 'emulated' or a CUDA device index, got {device!r}")
    torch = _torch()
    if torch is None:
        why = "no CUDA device: torch is not installed"
    elif not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        why = f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
    else:
        why = ""
    if spec in ("auto", "cuda"):
        return DeviceChoice(DeviceKind.EMULATED, reason=why) if why else DeviceChoice(DeviceKind.CUDA, 0)
    index = int(spec.removeprefix("cuda:"))
    if why:
        raise TierError(f"device: CUDA device {index} requested but {why}")
    if index >= torch.cuda.device_count():
        raise TierError(f"device: CUDA device {index} requested, but only {torch.cuda.device_count()} present")
    return DeviceChoice(DeviceKind.CUDA, index)


# --- emulated stream and event ------------------------------------------------------------

class EmuEvent:
    """Stands in for a CUDA event: set by its stream's thread once the work before it ran."""

    __slots__ = ("_set", "error")

    def __init__(self) -> None:
        self._set = threading.Event()
        self.error: BaseException | None = None

    def _fire(self, error: BaseException | None) -> None:
        self.error = error
        self._set.set()

    def query(self) -> bool:
        return self._set.is_set()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Block until the event fires; raise the error of the op it closes."""
        if not self._set.wait(timeout_s):
            raise TimeoutError(f"event not reached after {timeout_s} s")
        if self.error is not None:
            raise self.error


class EmuStream:
    """Stands in for a CUDA stream: one thread runs submitted work in FIFO order."""

    emulated = True

    def __init__(self, name: str = "kvstore-emu-stream") -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def _run(self) -> None:
        pending: BaseException | None = None  # error of the op since the last recorded event
        while True:
            kind, arg = self._q.get()
            if kind == "stop":
                return
            if kind == "wait":
                ev, propagate = arg
                ev._set.wait()
                if propagate and ev.error is not None and pending is None:
                    pending = TierError(f"an earlier transfer this one waited on failed: {ev.error}")
            elif kind == "fn":
                if pending is None:  # an op whose input failed does not run
                    try:
                        arg()
                    except BaseException as e:  # noqa: BLE001 - handed to the event, not lost
                        pending = e
            else:  # record
                arg._fire(pending)
                pending = None

    def submit(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise TierError("stream closed")
        self._q.put(("fn", fn))

    def record(self) -> EmuEvent:
        ev = EmuEvent()
        self._q.put(("record", ev))
        return ev

    def wait_event(self, ev, propagate: bool = True) -> None:
        """Run nothing submitted after this until ``ev`` fired; with ``propagate`` the next
        recorded op fails (without running) when the op ``ev`` closes failed."""
        self._q.put(("wait", (ev, propagate)))

    def synchronize(self) -> None:
        self.record()._set.wait()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._q.put(("stop", None))
            self._thread.join()



class InlineStream(EmuStream):
    """An :class:`EmuStream` whose work runs at once in the submitting thread, for CPU caches
    that are the engine's real device (vLLM's CPU backend), not a GPU's stand-in: their
    copies are waited for as soon as they are issued, so a copy thread only adds a hand-off
    and competes with the forward's threads for the cores. Same API and error semantics:
    an op that fails makes the next recorded event fail; ``wait_event`` blocks the caller."""

    def __init__(self, name: str = "kvstore-inline-stream") -> None:
        self._closed = False
        self._pending: BaseException | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise TierError("stream closed")
        if self._pending is None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the next event, as on a copy thread
                self._pending = e

    def record(self) -> EmuEvent:
        ev = EmuEvent()
        ev._fire(self._pending)
        self._pending = None
        return ev

    def wait_event(self, ev, propagate: bool = True) -> None:
        ev._set.wait()
        if propagate and ev.error is not None and self._pending is None:
            self._pending = TierError(f"an earlier transfer this one waited on failed: {ev.error}")

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self._closed = True

# --- CUDA stream and event ----------------------------------------------------------------

class CudaEvent:
    __slots__ = ("raw", "error")

    def __init__(self, raw) -> None:
        self.raw = raw  # torch.cuda.Event
        self.error = None

    def query(self) -> bool:
        return self.raw.query()

    def synchronize(self, timeout_s: float | None = None) -> None:
        # cudaEventSynchronize has no timeout; callers bound waits through CopyHandle.wait.
        self.raw.synchronize()


class CudaStream:
    """A non-default torch CUDA stream. ``submit`` runs ``fn`` now, on the caller's thread,
    with this stream current, so the GPU work it launches is queued on this stream."""

    emulated = False

    def __init__(self, device_index: int, priority: int = 0) -> None:
        import torch

        self._torch = torch
        self.raw = torch.cuda.Stream(device=device_index, priority=priority)
        self.device_index = device_index

    def submit(self, fn: Callable[[], None]) -> None:
        with self._torch.cuda.device(self.device_index), self._torch.cuda.stream(self.raw):
            fn()

    def record(self) -> CudaEvent:
        ev = self._torch.cuda.Event(blocking=True)
        ev.record(self.raw)
        return CudaEvent(ev)

    def wait_event(self, ev, propagate: bool = True) -> None:
        # CUDA errors are sticky for the whole context: there is nothing to propagate.
        self.raw.wait_event(ev.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def close(self) -> None:
        self.raw.synchronize()


def make_stream(choice: DeviceChoice, name: str = "kvstore-stream", inline: bool = False):
    """A CUDA stream on a CUDA choice; else an emulated one (a copy thread), or with ``inline``
    an :class:`InlineStream`."""
    if choice.kind is DeviceKind.CUDA:
        return CudaStream(choice.index)
    return InlineStream(name) if inline else EmuStream(name)


# --- lanes: a stream plus the thread that completes its CopyHandle handles --------------------

class Lane:
    """One stream and a completer thread that finishes each op's :class:`CopyHandle` when its
    event fires. Events on one stream fire in order, so one FIFO thread per lane suffices."""

    def __init__(self, stream, name: str) -> None:
        self.stream = stream
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._complete, name=f"{name}-done", daemon=True)
        self._thread.start()

    def _complete(self) -> None:
        while True:
            item = self._done.get()
            if item is None:
                return
            ev, transfer, _keepalive = item
            try:
                ev.synchronize()
                transfer.finish()
            except BaseException as e:  # noqa: BLE001 - the handle carries it
                transfer.finish(e)

    def run(self, fn: Callable[[], None], deps, transfer: CopyHandle, keepalive=None):
        """Queue ``fn`` after ``deps`` (``(event, propagate)`` of other lanes); return the
        op's event. ``keepalive`` holds buffers the copy reads or writes until it is done."""
        for ev, propagate in deps:
            self.stream.wait_event(ev, propagate)
        self.stream.submit(fn)
        ev = self.stream.record()
        self._done.put((ev, transfer, keepalive))
        return ev

    def close(self) -> None:
        self.stream.synchronize()
        self._done.put(None)
        self._thread.join()
        self.stream.close()


# --- pinned host memory --------------------------------------------------------------------

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context in the process

# cudaHostRegister fails on a range already registered, and the failure would stay behind as
# the thread's "last error" for torch's next kernel-launch check. One registration per range,
# counted, shared by every HostPin of the process (the tier and a client in one process).
_pins: dict[tuple[int, int], int] = {}
_pins_lock = threading.Lock()


def libcudart():
    """The CUDA runtime torch loaded (ctypes), for the calls ``torch.cuda.cudart()`` lacks; None
    when none is found. dlopen by soname returns the copy already in the process."""
    import ctypes

    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _clear_last_cuda_error() -> None:
    lib = libcudart()
    if lib is not None and hasattr(lib, "cudaGetLastError"):
        lib.cudaGetLastError()


class HostPin:
    """Page-locks ``[ptr, ptr + nbytes)`` in place with ``cudaHostRegister`` so GPU copies to
    and from it are DMA (the shared arena cannot be re-allocated as torch pinned memory: it is
    the daemon's memfd). Emulated: records the intent, pins nothing."""

    def __init__(self, choice: DeviceChoice, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes, self.emulated = ptr, nbytes, choice.emulated
        self._registered = False
        if self.emulated or nbytes == 0:
            return
        import torch

        key = (ptr, nbytes)
        with _pins_lock:
            if key not in _pins:
                with torch.cuda.device(choice.index):
                    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))
                if err != 0:
                    _clear_last_cuda_error()
                    raise TierError(f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed with cudaError {err} "
                                    "(is the locked-memory limit, ulimit -l, too low?)")
                _pins[key] = 0
            _pins[key] += 1
        self._registered = True

    @property
    def pinned(self) -> bool:
        return self._registered

    def close(self) -> None:
        if not self._registered:
            return
        import torch

        self._registered = False
        key = (self.ptr, self.nbytes)
        with _pins_lock:
            _pins[key] -= 1
            if _pins[key] == 0:
                del _pins[key]
                torch.cuda.cudart().cudaHostUnregister(self.ptr)
