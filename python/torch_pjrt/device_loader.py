"""DeviceLoader: a data loader's batches on the tpu device, uploaded in the background.

The role of torch_xla's MpDeviceLoader. A background thread takes the loader's next
batches, pins their host tensors and issues non_blocking uploads, so the copies
overlap with the training step running on the caller's thread (ops release the GIL).
See docs/design/storage.md, "Pinned memory and non_blocking copies".
"""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
import queue
import threading

import torch

__all__ = ["DeviceLoader"]

# What the background thread puts in the queue: (kind, value).
_BATCH, _ERROR, _END = "batch", "error", "end"


def _tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_pinned():
        # Already-pinned memory may belong to the loader (a reused buffer), so the
        # copy waits until it is read: only our own pinned copies are left in flight.
        return tensor.to(device)
    # A fresh pinned copy that nothing else references: its upload need not be waited for.
    return tensor.pin_memory().to(device, non_blocking=True)


def move_to_device(data, device: torch.device):
    """`data` with every tensor moved to `device`, through the containers
    torch.utils.data's pin_memory walks (mappings, namedtuples, tuples, sequences)
    and dataclasses; other objects (strings, numbers, custom types) pass through."""
    if isinstance(data, torch.Tensor):
        return _tensor_to_device(data, device)
    if isinstance(data, torch.nn.utils.rnn.PackedSequence):  # its batch_sizes stay on the CPU
        return data.to(device)
    if isinstance(data, (str, bytes)):
        return data
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        # Field by field on a copy: no __init__/__post_init__ rerun, frozen ones too.
        clone = copy.copy(data)
        for field in dataclasses.fields(data):
            object.__setattr__(clone, field.name, move_to_device(getattr(data, field.name), device))
        return clone
    if isinstance(data, collections.abc.Mapping):
        moved = {key: move_to_device(value, device) for key, value in data.items()}
        try:
            if isinstance(data, collections.abc.MutableMapping):
                clone = copy.copy(data)  # keeps the mapping type's extra state
                clone.update(moved)
                return clone
            return type(data)(moved)
        except TypeError:
            return moved
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*(move_to_device(value, device) for value in data))
        return type(data)(move_to_device(value, device) for value in data)
    if isinstance(data, collections.abc.Sequence):
        moved = [move_to_device(value, device) for value in data]
        try:
            if isinstance(data, collections.abc.MutableSequence):
                clone = copy.copy(data)
                for i, value in enumerate(moved):
                    clone[i] = value
                return clone
            return type(data)(moved)
        except TypeError:
            return moved
    return data


def _produce(source, device: torch.device, stream, out: queue.Queue, stop: threading.Event) -> None:
    """The background thread: next batch, upload on the loader's stream, queue it with an
    event recorded after its uploads; an error or the end is queued in its place, after
    the batches before it. Holds no reference to the consumer."""
    try:
        while not stop.is_set():
            try:
                batch = next(source)
            except StopIteration:
                out.put((_END, None))
                return
            if stop.is_set():
                return
            with torch.tpu.stream(stream):
                moved = move_to_device(batch, device)
                uploaded = stream.record_event()
            out.put((_BATCH, (moved, uploaded)))
            del moved
            del batch
    except BaseException as error:  # the loader's or the upload's: raised in the consumer
        if not stop.is_set():
            out.put((_ERROR, error))
    finally:
        # The traceback of a forwarded error keeps this frame: drop the loader's
        # iterator here so its worker processes shut down now.
        source = None  # noqa: F841


class _DeviceLoaderIterator:
    """One pass over the loader, `prefetch` batches ahead on a background thread."""

    def __init__(self, loader, device: torch.device, prefetch: int):
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._finished = False
        # Made here, on the caller's thread: DataLoader workers fork before our thread exists.
        source = iter(loader)
        self._device = device
        self._stream = torch.tpu.Stream(device)  # the uploads' side stream, as CUDA prefetchers use
        self._thread = threading.Thread(target=_produce,
                                        args=(source, device, self._stream, self._queue, self._stop),
                                        name="torch_pjrt.DeviceLoader", daemon=True)
        del source
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == _BATCH:
            batch, uploaded = value
            torch.tpu.current_stream(self._device).wait_event(uploaded)  # the caller's stream after the uploads
            return batch
        self._finished = True
        self._thread.join()
        if kind == _ERROR:
            try:
                raise value
            finally:
                value = None  # no cycle through this frame
        raise StopIteration

    def close(self) -> None:
        """Stops the background thread (iteration stopped early); batches already uploaded are dropped."""
        thread = getattr(self, "_thread", None)
        if thread is None:
            return
        self._finished = True
        self._stop.set()
        self._drain()  # unblocks a put() waiting for room
        if thread is not threading.current_thread():
            thread.join()
        self._drain()
        self._thread = None

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter teardown: nothing left to stop
            pass


class DeviceLoader:
    """Iterates `loader` with every batch on `device`, uploaded `prefetch` batches ahead.

        loader = torch_pjrt.DeviceLoader(DataLoader(dataset, batch_size=32, num_workers=2))
        for x, y in loader:          # already on tpu
            loss = model(x).loss(y) ...

    Each batch's tensors, inside tuples, lists, dicts, namedtuples and dataclasses (as
    DataLoader(pin_memory=True) walks them), are moved to `device`; other values pass
    through. A background thread pins each host tensor (unless it is pinned already)
    and uploads it with a non_blocking copy on a side stream, so the next batches' copies
    overlap with the step the caller runs; the caller's current stream waits for each
    batch's uploads (an event) when the batch is handed over. At most `prefetch` uploaded batches wait in a queue (and
    one more may be uploaded, waiting for room).

    - An exception from the loader (or an upload) is raised by the iteration at the batch
      where it happened; the iteration then ends.
    - Stopping early (`break`, dropping the iterator, or its `close()`) stops the thread.
    - `len()` is the loader's; other attributes (`sampler`, `dataset`, `batch_size`, ...)
      are the loader's, so `loader.sampler.set_epoch(epoch)` works with a DistributedSampler.
    - DataLoader workers do CPU work only: the device is touched on the caller's process.
    - Tensors already pinned by the loader are copied before the loader is asked for the
      next batch (it may reuse them); only DeviceLoader's own pinned copies stay in flight.
    - `device` "tpu" means the current tpu device when iteration starts.
    """

    def __init__(self, loader, device="tpu", prefetch: int = 2):
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"DeviceLoader: the loader must be iterable, got {type(loader).__name__}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"DeviceLoader: prefetch must be an int >= 1, got {prefetch!r}")
        device = torch.device(device)
        if device.type != "tpu":
            raise ValueError(f"DeviceLoader: expected a tpu device, got {device}")
        self.loader = loader
        self.device = device
        self.prefetch = prefetch

    def _target_device(self) -> torch.device:
        if self.device.index is not None:
            return self.device
        return torch.device("tpu", torch.tpu.current_device())

    def __iter__(self) -> _DeviceLoaderIterator:
        # Start the runtime before the loader forks its workers: a worker forked after
        # it is a "bad fork" that cannot touch the device (torch.manual_seed skips it
        # there), instead of starting a PJRT client of its own.
        count = torch.tpu.device_count()
        device = self._target_device()
        if device.index >= count:
            raise ValueError(f"DeviceLoader: {device} does not exist: there {'is' if count == 1 else 'are'} "
                             f"{count} tpu device{'' if count == 1 else 's'}")
        return _DeviceLoaderIterator(self.loader, device, self.prefetch)

    def __len__(self) -> int:
        try:
            return len(self.loader)
        except TypeError:
            raise TypeError(f"DeviceLoader: the loader ({type(self.loader).__name__}) has no len()") from None

    def __getattr__(self, name):
        # Only for names DeviceLoader lacks; "loader" itself is missing while unpickling.
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"DeviceLoader({self.loader!r}, device={str(self.device)!r}, prefetch={self.prefetch})"
