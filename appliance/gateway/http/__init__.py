"""The gateway's HTTP layer: the server and its bounds, what it says to bad HTTP, and the one
middleware every request passes (refusals, authentication, scope)."""
