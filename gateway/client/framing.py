"""Deprecated alias of ``kvgw_client.framing`` (see ``gateway.client``)."""

from gateway.client import alias

alias(__name__)
