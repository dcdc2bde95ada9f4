"""Media URLs in a request: only inline ``data:`` URLs, unless the model allows hosts.

A multimodal model's engine fetches the http(s) URLs it is given (images, audio, video)
from the box itself: a request could make the appliance reach any host its network
reaches, the LAN's included, and wait up to vLLM's fetch timeouts doing it. So each
model takes ``data:`` URLs only, unless its ``allowed_media_domains`` lists hosts; an
http(s) URL on one of them passes (the engine gets the same list as
``--allowed-media-domains`` and follows no redirect: engine.py). Anything else (another
host, ``file:``, another scheme) is a 400 naming where in the body it is.

Where URLs are: in the route's content fields (``Route.media_fields``: ``messages``,
Responses' ``input``, scoring's inputs), at any depth, as the string value of a key
named ``url``, ``image_url``, ``audio_url``, ``video_url`` or ``file_url``: chat's
``{"type": "image_url", "image_url": {"url": ...}}`` (and vLLM's forms without
``type``), ``audio_url``, ``video_url``, Responses' ``input_image`` (``image_url``) and
``input_file`` (``file_url``), Messages' ``{"source": {"type": "url", "url": ...}}``,
also inside tool results. Only those fields are walked, so a JSON schema or metadata
that mentions a URL is never mistaken for media.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from appliance.config import ServedModel
from appliance.gateway.errors import GatewayError

URL_KEYS = frozenset({"url", "image_url", "audio_url", "video_url", "file_url"})


def media_urls(body: Mapping[str, Any], fields: Sequence[str]) -> Iterator[tuple[str, str]]:
    """(where, url) of every media URL in ``fields`` of ``body``; ``where`` as a client
    would point at it, e.g. ``messages[0].content[1].image_url.url``."""
    stack: list[tuple[str, Any]] = [(f, body[f]) for f in reversed(fields) if f in body]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in reversed(value.items()):
                if isinstance(item, str):
                    if key in URL_KEYS:
                        yield f"{where}.{key}", item
                elif isinstance(item, (dict, list)):
                    stack.append((f"{where}.{key}", item))
        elif isinstance(value, list):
            stack.extend(
                (f"{where}[{i}]", item)
                for i, item in reversed(list(enumerate(value)))
                if isinstance(item, (dict, list))
            )


def url_allowed(url: str, hosts: Sequence[str]) -> bool:
    """Whether the engine may be given ``url``: inline data, or http(s) on a listed host
    (compared as vLLM does, by the URL's host name alone)."""
    if url[:5].lower() == "data:":
        return True
    if not hosts:
        return False
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname
    except ValueError:  # e.g. an invalid IPv6 literal: the engine would refuse it too
        return False
    return parts.scheme.lower() in ("http", "https") and host is not None and host in hosts


def domains_key(model: ServedModel, tables: bool) -> str:
    """The config key that lists ``model``'s media hosts, as an admin writes it."""
    return (
        f"models.{model.name}.allowed_media_domains" if tables else "engine.allowed_media_domains"
    )


def media_refusal(
    fields: Sequence[str], body: Mapping[str, Any], model: ServedModel, tables: bool
) -> GatewayError | None:
    """The 400 for the first media URL in ``body`` that ``model`` may not fetch; else None."""
    if not fields:
        return None
    hosts = model.engine.allowed_media_domains
    for where, url in media_urls(body, fields):
        if url_allowed(url, hosts):
            continue
        allowed = (
            "only inline data: URLs and http(s) URLs on " + ", ".join(hosts)
            if hosts
            else "only inline data: URLs (base64)"
        )
        return GatewayError(
            400,
            f"'{where}': this server does not fetch media from URLs like this one for "
            f"model '{model.name}'; it takes {allowed}. Send the media inline as a "
            f"data: URL; the operator can allow hosts with {domains_key(model, tables)}.",
            param=where,
            code="media_url_not_allowed",
            reason="bad_request",
        )
    return None
