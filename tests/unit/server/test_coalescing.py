"""CoalescingTransport: the writes of one loop step leave together, in order."""
import asyncio

from kiln.server.coalescing import CoalescingTransport


class Recording:
    def __init__(self):
        self.sends: list[list[bytes]] = []
        self.closed = self.aborted = False

    def writelines(self, data):
        self.sends.append(list(data))

    def is_closing(self):
        return self.closed or self.aborted

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = True

    def get_write_buffer_size(self):
        return 0

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


def test_head_and_body_of_one_step_leave_in_one_send():
    async def main():
        inner = Recording()
        transport = CoalescingTransport(inner, asyncio.get_running_loop())
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b"")
        transport.write(b"body")
        assert inner.sends == [] and transport.get_write_buffer_size() == 23
        await asyncio.sleep(0)
        transport.write(b"next")
        await asyncio.sleep(0)
        return inner.sends
    assert asyncio.run(main()) == [[b"HTTP/1.1 200 OK\r\n\r\n", b"body"], [b"next"]]


def test_close_sends_what_is_pending_first_and_abort_drops_it():
    async def main():
        loop = asyncio.get_running_loop()
        closed, aborted = Recording(), Recording()
        a, b = CoalescingTransport(closed, loop), CoalescingTransport(aborted, loop)
        a.write(b"last words")
        a.close()
        b.write(b"never sent")
        b.abort()
        await asyncio.sleep(0)
        assert a.get_extra_info("peername") == ("127.0.0.1", 1) and a.is_closing()
        return closed.sends, closed.closed, aborted.sends, aborted.aborted
    assert asyncio.run(main()) == ([[b"last words"]], True, [], True)
