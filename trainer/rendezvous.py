"""The rendezvous store of a multi-node job, hosted by a coordinator that does not train.

torchrun's c10d rendezvous keeps its state in a ``TCPStore``. When the on-demand coordinator also
trains, its own torchrun agent hosts the store (``is_host=true``); when it does not, this process
does, and every agent joins it as a client. The store lives as long as this process: SIGTERM
(systemd stopping the unit) ends it with exit 0.
"""
from __future__ import annotations

import logging
import signal
import threading
from datetime import timedelta

from trainer.observe.progress import setup_logging


def serve(host: str, port: int, *, ready: threading.Event | None = None,
          stop: threading.Event | None = None) -> int:
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
    stop.wait()
    log.info("event=rendezvous_stopped")
    logging.shutdown()
    return 0
