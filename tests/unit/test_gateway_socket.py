"""The gateway's listening socket: connections accepted on it send small writes at once
(TCP_NODELAY). Without it, Nagle's algorithm held a stream's first chunk behind its
headers until the client's delayed ACK (~40 ms) on every keep-alive request: asyncio
sets TCP_NODELAY only on sockets whose protocol reads IPPROTO_TCP."""

from __future__ import annotations

import asyncio
import socket

from radixserve.services.gateway.service import bind_socket


async def _accepted_nodelay() -> int:
    sock = bind_socket("127.0.0.1", 0)
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Server, sock=sock)  # as uvicorn serves it
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(accepted, 5)
        finally:
            writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_accepted_connections_have_tcp_nodelay() -> None:
    assert asyncio.run(_accepted_nodelay()) != 0
