"""scalelab.headless: a kernel channel that still gets its message when the socket's wake-up was lost, waits for a
late message, and gives up at its deadline and not before; papermill runs a notebook through its kernel manager."""

from __future__ import annotations

import asyncio
import time
from queue import Empty

import nbformat
import papermill
import pytest
import zmq
import zmq.asyncio
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.session import Session
from nbformat.v4 import new_code_cell, new_notebook

from scalelab import headless


class SocketPair:
    """The kernel's end (a plain DEALER) and the client's end (an asyncio DEALER) of one connection."""

    def __init__(self, channel_class):
        self.context = zmq.Context()
        self.async_context = zmq.asyncio.Context.shadow(self.context)
        self.client = self.async_context.socket(zmq.DEALER)
        port = self.client.bind_to_random_port("tcp://127.0.0.1")
        self.kernel = self.context.socket(zmq.DEALER)
        self.kernel.connect(f"tcp://127.0.0.1:{port}")
        self.session = Session(key=b"")
        self.channel = channel_class(self.client, self.session)

    def send_from_kernel(self, text):
        self.session.send(self.kernel, "stream", {"name": "stdout", "text": text})

    def close(self):
        self.client.close(linger=0)
        self.kernel.close(linger=0)
        self.context.term()


async def wait_through_a_missed_wake_up(pair: SocketPair, patience_s: float):
    """Start waiting for a message, then let one arrive while the loop is not looking and consume the socket's
    edge-triggered wake-up (reading ZMQ_EVENTS does) before the loop sees it: what happens to nbclient's wait."""
    waiting = asyncio.ensure_future(pair.channel.get_msg(timeout=None))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    pair.send_from_kernel("late")
    time.sleep(0.3)  # blocks the loop: the message lands in the client's socket
    assert pair.client.getsockopt(zmq.EVENTS) & zmq.POLLIN
    return await asyncio.wait_for(waiting, patience_s)


def test_a_plain_channel_misses_the_message_whose_wake_up_was_consumed():
    # The failure PollingChannel exists for: jupyter_client's own channel never ends this wait, message or not.
    pair = SocketPair(AsyncZMQSocketChannel)
    try:
        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(wait_through_a_missed_wake_up(pair, patience_s=3.0))
    finally:
        pair.close()


def test_the_polling_channel_gets_the_message_whose_wake_up_was_consumed():
    pair = SocketPair(headless.PollingChannel)
    try:
        message = asyncio.run(wait_through_a_missed_wake_up(pair, patience_s=3.0))
        assert message["content"]["text"] == "late"
    finally:
        pair.close()


def test_the_polling_channel_waits_as_long_as_it_takes_when_there_is_no_deadline():
    pair = SocketPair(headless.PollingChannel)

    async def late_message():
        waiting = asyncio.ensure_future(pair.channel.get_msg(timeout=None))
        await asyncio.sleep(2.0)
        assert not waiting.done()
        pair.send_from_kernel("two seconds later")
        return await asyncio.wait_for(waiting, 3.0)

    try:
        assert asyncio.run(late_message())["content"]["text"] == "two seconds later"
    finally:
        pair.close()


def test_the_polling_channel_gives_up_at_its_deadline_and_not_before():
    pair = SocketPair(headless.PollingChannel)
    try:
        started = time.monotonic()
        with pytest.raises(Empty):
            asyncio.run(pair.channel.get_msg(timeout=0.5))
        assert time.monotonic() - started >= 0.5
    finally:
        pair.close()


def test_papermill_runs_a_notebook_with_a_slider_through_the_polling_kernel_manager(tmp_path):
    source = tmp_path / "slider.ipynb"
    nbformat.write(new_notebook(cells=[
        new_code_cell("from ipywidgets import IntSlider, interactive\n"
                      "interactive(lambda n: print('square', n * n), n=IntSlider(value=7, min=0, max=9))"),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}), source)
    executed = tmp_path / "slider_executed.ipynb"
    papermill.execute_notebook(str(source), str(executed), kernel_name="python3", progress_bar=False,
                               kernel_manager_class=headless.PollingKernelManager, execution_timeout=120)
    widget_state = nbformat.read(executed, as_version=4).metadata["widgets"][
        "application/vnd.jupyter.widget-state+json"]["state"]
    printed = [output.get("text", "") for model in widget_state.values() if model["model_name"] == "OutputModel"
               for output in model["state"].get("outputs", [])]
    assert "square 49\n" in printed
