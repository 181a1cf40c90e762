"""Running the course's notebooks without a browser (papermill in the tests, nbgrader's validate and autograde).

jupyter_client's asyncio channels wait for a kernel's next message with an open-ended zmq poll, which pyzmq wakes
through the socket's edge-triggered file descriptor. After lab 1's ``interactive()`` slider that wake-up is sometimes
lost although the cell's ``execute_reply`` is already in the shell socket, and the run hangs with an idle kernel
(about one run in three on a 2-core machine, with ipykernel 6 and 7 and pyzmq 26 and 27 alike; jupyter/nbclient#312
is the same hang). The channels here do not wait for a wake-up: they ask the socket whether a message is there
(ZMQ_EVENTS, level-triggered) every ``POLL_INTERVAL_S`` and read it when it is.

Use ``kernel_manager_class=PollingKernelManager`` with papermill or nbclient, and ``with_polling_execute`` on an
nbgrader preprocessor list (nbgrader's ``Execute`` passes its own kernel manager class, so configuring
``c.Execute.kernel_manager_class`` has no effect).
"""

from __future__ import annotations

import asyncio
import time
from queue import Empty
from typing import Any

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from nbgrader.preprocessors import Execute as NbgraderExecute
from traitlets import DottedObjectName, Type
import zmq

# A message waits at most this long to be noticed; checking 200 times a second costs no measurable CPU.
POLL_INTERVAL_S = 0.005


class PollingChannel(AsyncZMQSocketChannel):
    """A kernel channel that looks for its next message every POLL_INTERVAL_S instead of waiting to be woken."""

    async def get_msg(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if deadline is not None and time.monotonic() >= deadline:
                raise Empty
            await asyncio.sleep(POLL_INTERVAL_S)
        return await self._recv()


class PollingKernelClient(AsyncKernelClient):
    shell_channel_class = Type(PollingChannel)
    iopub_channel_class = Type(PollingChannel)
    stdin_channel_class = Type(PollingChannel)
    control_channel_class = Type(PollingChannel)


class PollingKernelManager(AsyncKernelManager):
    """A kernel manager whose clients read the kernel through PollingChannel."""

    client_class = DottedObjectName("scalelab.headless.PollingKernelClient")
    client_factory = Type(PollingKernelClient)


class Execute(NbgraderExecute):
    """nbgrader's Execute preprocessor (validate, autograde) reading the kernel with PollingChannel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("kernel_manager_class", PollingKernelManager)
        super().__init__(*args, **kwargs)


def with_polling_execute(preprocessors: list) -> list:
    """An nbgrader preprocessor list (e.g. a converter's default) with its Execute replaced by the one above."""
    return [Execute if preprocessor is NbgraderExecute else preprocessor for preprocessor in preprocessors]
