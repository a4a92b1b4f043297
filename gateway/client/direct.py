"""Deprecated alias of ``kvgw_client.direct`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
