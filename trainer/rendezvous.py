"""The rendezvous store of a multi-node job, hosted by a coordinator that does not train, and the
rendezvous id its nodes join.

torchrun's c10d rendezvous keeps its state in a ``TCPStore``. When the on-demand coordinator also
trains, its own torchrun agent hosts the store (``is_host=true``); when it does not, this process
does, and every agent joins it as a client. The store lives as long as this process: SIGTERM
(systemd stopping the unit) ends it with exit 0.

A torchrun agent that ends other than by a signal (its workers failed ``--max-restarts`` times,
they finished, or its join timed out waiting for a node a stockout keeps away) closes the
rendezvous of its id for good: every later join of that id fails at once. A store that outlives
the agents would keep the job from ever training again, so its nodes join ``<name>-<epoch>``
(``rendezvous_id``): the epoch is a counter in this store, advanced (compare-and-set, once however
many nodes find it closed) when the rendezvous of the current epoch is closed. A stop or a
preemption (a signal) leaves the rendezvous open: the epoch stays and a replacement joins the
nodes that wait in it.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import sys
from datetime import timedelta

from trainer.observe.progress import HEARTBEAT_S, setup_logging

#: The store key of a job's rendezvous epoch (torch's own keys start with "torch.").
EPOCH_KEY = "spottrain.rendezvous_epoch."


def serve(host: str, port: int, *, ready: threading.Event | None = None,
          stop: threading.Event | None = None, heartbeat_s: float = HEARTBEAT_S) -> int:
    from torch.distributed import TCPStore

    log = setup_logging(0)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    try:
        # multi_tenant: the agents' stores in this process (none here) share the listener, the
        # same way the c10d backend opens it; wait_for_workers=False: agents come and go.
        store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))
    except (RuntimeError, ValueError) as e:
        log.error("event=rendezvous_failed host=%s port=%d detail=%s", host, port, e)
        return 1
    log.info("event=rendezvous_store host=%s port=%d", host, store.port)
    if ready is not None:
        ready.set()
    # The trainer unit is active here and never steps: without a line now and then the node's log
    # shipper would report a stall every stall_minutes for as long as the pool runs.
    while not stop.wait(heartbeat_s):
        log.info("event=heartbeat role=rendezvous (the coordinator hosts the rendezvous store; it does not train)")
    log.info("event=rendezvous_stopped")
    logging.shutdown()
    return 0


class StoreUnreachable(Exception):
    """The rendezvous store did not answer (or answered nonsense) within the timeout."""


def rendezvous_id(host: str, port: int, name: str, *, timeout_s: float = 60.0) -> str:
    """``<name>-<epoch>``: the id of the job's rendezvous that is open now, in the store at
    host:port, the epoch advanced past every closed one."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    try:
        store = TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, TimeoutError) as e:
        raise StoreUnreachable(_one_line(e)) from e
    key = EPOCH_KEY + name

    def epoch_of(value: bytes) -> int:
        if not value.isdigit() or len(value) > 18:
            raise StoreUnreachable(f"key {key} holds {value[:40]!r}, not an epoch")
        return int(value)

    try:
        epoch = epoch_of(store.compare_set(key, "", "0"))  # created at 0 by the first node to ask
        while True:
            run_id = f"{name}-{epoch}"
            # torch's own handler reads the state the way every agent in the rendezvous reads it;
            # it only reads (min/max nodes matter to a join, not to is_closed).
            backend = C10dRendezvousBackend(store, run_id)
            handler = DynamicRendezvousHandler.from_backend(run_id, store, backend, min_nodes=1, max_nodes=1)
            if not handler.is_closed():
                return run_id
            # Several nodes may find it closed at once: the first one's write wins, the others
            # read the epoch it wrote.
            epoch = epoch_of(store.compare_set(key, str(epoch), str(epoch + 1)))
    except (RuntimeError, ValueError, TimeoutError) as e:
        raise StoreUnreachable(_one_line(e)) from e
    except Exception as e:  # torch's rendezvous errors (connection, corrupt state)
        if type(e).__module__.startswith("torch.distributed"):
            raise StoreUnreachable(_one_line(e)) from e
        raise


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


def print_id(endpoint: str, name: str, timeout_s: float) -> int:
    """``rendezvous-id``: print the id, or one line on stderr and exit 1 (a unit restart retries)."""
    host, _, port = endpoint.rpartition(":")
    # c10d's C++ log would add a stack trace per connection attempt to the one line below.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    try:
        print(rendezvous_id(host, int(port), name, timeout_s=timeout_s))
    except StoreUnreachable as e:
        print(f"rendezvous-id: no rendezvous id from the store at {endpoint} (timeout {timeout_s:g} s): {e}",
              file=sys.stderr)
        return 1
    return 0
