"""The wire below aiohttp: HTTP/1.1 framing to the engines, the keep-alive pool, and
the splice of streamed answers."""
